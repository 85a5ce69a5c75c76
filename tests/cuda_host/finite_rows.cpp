// Host harness commands of finite_rows (csrc/cuda/finite_rows.cuh), driven by tests/test_finite_rows.py.
// Protocol: see harness.h; one line in, one line out:
//   finite V size u_off K d ld U[K*ld]       -> vec ok[K] (rows scanned as finite_kernel's blocks; ERR on a
//                                       column covered other than once or a misaligned vector load)
#include "harness.h"

#include "finite_rows.cuh"

FK_HOST_COMMAND(finite) {
  // finite_kernel: V elements per 16-byte vector, element size `size`, U's base at byte address u_off
  const int V = (int)ri(in), size = (int)ri(in);
  const long long u_off = ri(in), K = ri(in), d = ri(in), ld = ri(in);
  std::vector<double> U(K * ld);
  for (auto& x : U) x = rd(in);
  const bool vec = fr::vec_ok((uintptr_t)u_off, ld * size, K);
  const long long nch = fr::num_chunks(d, V);
  std::vector<int> hits(K * d, 0);
  std::vector<int> ok(K, 1);
  bool misaligned = false;
  for (long long b = 0; b < K * nch; ++b) {
    int64_t row, j0;
    fr::block_span(b, nch, V, row, j0);
    bool any = false;
    for (int tid = 0; tid < fr::kThreads; ++tid) {
      if (vec && fr::full_chunk(j0, d, V)) {
        for (int u = 0; u < fr::kUnroll; ++u) {
          const long long j = fr::vec_col(j0, u, tid, V, 0);
          if ((u_off + (row * ld + j) * size) % 16 != 0) misaligned = true;
          for (int e = 0; e < V; ++e) {
            const long long jj = fr::vec_col(j0, u, tid, V, e);
            if (jj >= d) { misaligned = true; continue; }  // a vector past the row end
            ++hits[row * d + jj];
            any |= fr::bad(U[row * ld + jj]);
          }
        }
      } else {
        for (long long s = 0; s < (long long)V * fr::kUnroll; ++s) {
          const long long j = fr::scalar_col(j0, s, tid);
          if (j >= d) continue;
          ++hits[row * d + j];
          any |= fr::bad(U[row * ld + j]);
        }
      }
    }
    if (any) ok[row] = 0;  // __syncthreads_or, then thread 0 writes false
  }
  bool cover = true;
  for (int h : hits) cover = cover && h == 1;
  if (!cover || misaligned) {
    std::printf("ERR finite coverage=%d misaligned=%d\n", (int)cover, (int)misaligned);
    std::fflush(stdout);
    return;
  }
  std::printf("%d", vec ? 1 : 0);
  for (int v : ok) std::printf(" %d", v);
  std::printf("\n");
}
