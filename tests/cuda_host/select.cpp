// Host harness commands of select (csrc/cuda/select.cuh), driven by tests/test_select.py.
// Protocol: see harness.h; one line in, one line out:
//   select mode K d lo hi U[K*d]            -> out[d]: select_kernel's columns through sel:: (mode 0:
//                                           order_mean(lo, hi); 1: closest_mean(beta = lo)) and the rows'
//                                           finite flags ok[K] (as the kernel stores them)
#include "harness.h"

#include "select.cuh"

static void select_cmd(std::istream& in) {
  const long long mode = ri(in), K = ri(in), d = ri(in), lo = ri(in), hi = ri(in);
  std::vector<double> U(K * d);
  for (auto& x : U) x = rd(in);
  std::vector<int> ok(K, 1);
  std::printf("ok");
  for (long long j = 0; j < d; ++j) {   // one emulated thread per column
    auto x = [&](int64_t i) -> double { return U[i * d + j]; };
    for (long long i = 0; i < K; ++i)
      if (x(i) - x(i) != 0.0) ok[i] = 0;
    put(mode == 1 ? sel::closest_mean_col(x, K, lo) : sel::order_mean_col(x, K, lo, hi));
  }
  for (long long i = 0; i < K; ++i) std::printf(" %d", ok[i]);
  std::printf("\n");
}

FK_HOST_COMMAND(select) {
  select_cmd(in);
}
