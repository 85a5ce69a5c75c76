// Host harness commands of kstats (csrc/cuda/kstats.cuh), driven by tests/test_kstats.py.
// Protocol: see harness.h; one line in, one line out:
//   kstats eb K d U[K*d] p[K]               -> nparts TW dot[K] nsq[K] nbar: kstats_parts emulated (kstats_hd::plan;
//                                           per tile, phase 1's threads over (column, row group), phase 2's warps
//                                           over rows and lanes over columns, the butterfly warp sum), then
//                                           kstats_final's part sums. ERR on an element of U read other than
//                                           once per phase
#include "harness.h"

#include "kstats.cuh"

static void kstats_cmd(std::istream& in) {
  const long long eb = ri(in), K = ri(in), d = ri(in);
  std::vector<double> U(K * d), p(K);
  for (auto& x : U) x = rd(in);
  for (auto& x : p) x = rd(in);
  const kstats_hd::Plan pl = kstats_hd::plan(K, d, eb);
  const int64_t stride = 2 * K + 1, TW = pl.TW, G = kstats_hd::mean_groups(TW);
  std::vector<double> part(pl.nparts * stride, 0.0);
  std::vector<int> c1(K * d, 0), c2(K * d, 0);
  for (int64_t b = 0; b < pl.nparts; ++b) {
    double* dot = part.data() + b * stride;
    for (int64_t ti = 0; ti < pl.tpp; ++ti) {
      const int64_t j0 = (b * pl.tpp + ti) * TW;
      if (j0 >= d) break;
      const bool first = ti == 0;
      double smean[kstats_hd::kThreads], mean[256];
      for (int t = 0; t < kstats_hd::kThreads; ++t) {
        const int64_t c = kstats_hd::mean_col(t, TW), g = kstats_hd::mean_group(t, TW);
        double s = 0.0;
        if (j0 + c < d)
          for (int64_t k = g; k < K; k += G) {
            s += p[k] * U[k * d + j0 + c];
            ++c1[k * d + j0 + c];
          }
        smean[t] = s;
      }
      for (int t = 0; t < TW; ++t) {
        double m = smean[t];
        for (int64_t q = 1; q < G; ++q) m += smean[q * TW + t];
        mean[t] = m;
      }
      for (int w = 0; w < kstats_hd::kWarps; ++w)
        for (int64_t k = kstats_hd::row_first(w); k < K; k += kstats_hd::kWarps) {
          double sd[32], sn[32];
          for (int l = 0; l < 32; ++l) {
            sd[l] = sn[l] = 0.0;
            for (int64_t j = l; j < TW; j += 32)
              if (j0 + j < d) {
                const double v = U[k * d + j0 + j];
                ++c2[k * d + j0 + j];
                sd[l] += v * mean[j];
                sn[l] += v * v;
              }
          }
          const double a = butterfly(sd), q = butterfly(sn);
          dot[k] = first ? a : dot[k] + a;
          dot[K + k] = first ? q : dot[K + k] + q;
        }
      double sm[32];
      for (int l = 0; l < 32; ++l) {
        sm[l] = 0.0;
        for (int64_t j = l; j < TW; j += 32) sm[l] += mean[j] * mean[j];
      }
      const double a = butterfly(sm);
      dot[2 * K] = first ? a : dot[2 * K] + a;
    }
  }
  for (int64_t i = 0; i < K * d; ++i)
    if (c1[i] != 1 || c2[i] != 1) {
      std::printf("ERR kstats coverage\n");
      return;
    }
  std::printf("%lld %lld", (long long)pl.nparts, (long long)TW);
  for (int64_t i = 0; i < 2 * K + 1; ++i) put(kstats_hd::parts_sum(part.data(), pl.nparts, stride, i));
  std::printf("\n");
}

FK_HOST_COMMAND(kstats) {
  kstats_cmd(in);
}
