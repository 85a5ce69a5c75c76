// Host harness commands of gc_project (csrc/cuda/gc_project.cuh), driven by tests/test_gc_project.py.
// Protocol: see harness.h; one line in, one line out:
//   gcplan n rows[n] cols[n]         -> items, then per tensor: path and how often each row was covered
//                                       (emulating every block's gc::item and the per-path row loops)
#include "harness.h"

#include "gc_project.cuh"

FK_HOST_COMMAND(gcplan) {
  const long long n = ri(in);
  std::vector<GcTensor> t(n);
  for (auto& x : t) x.rows = ri(in);
  for (auto& x : t) x.cols = ri(in);
  const long long items = gc::plan(t.data(), n);
  std::vector<std::vector<int>> cover(n);
  for (long long i = 0; i < n; ++i) cover[i].assign(t[i].rows > 0 ? t[i].rows : 0, 0);
  for (long long b = 0; b < items; ++b) {  // one block per item
    int64_t ti, row0, nrows;
    gc::item(t.data(), n, b, ti, row0, nrows);
    if (t[ti].path == 0) {  // warp w handles rows row0 + rr * kWarps + w, rr < kRowsPerWarp
      for (int w = 0; w < gc::kWarps; ++w)
        for (int rr = 0; rr < gc::kRowsPerWarp; ++rr) {
          const int64_t r = row0 + (int64_t)rr * gc::kWarps + w;
          if (r >= row0 + nrows) break;
          ++cover[ti][r];
        }
    } else {
      ++cover[ti][row0];
    }
  }
  std::printf("%lld", items);
  for (long long i = 0; i < n; ++i) {
    int mn = 1 << 30, mx = 0;
    for (int c : cover[i]) {
      mn = c < mn ? c : mn;
      mx = c > mx ? c : mx;
    }
    if (cover[i].empty()) mn = mx = 1;
    std::printf(" %d:%d:%d", t[i].path, mn, mx);
  }
  std::printf("\n");
}
