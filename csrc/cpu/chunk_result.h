// What the column-chunked sums into a fresh result share (dequant_weighted_sum, sparse_weighted_sum): the
// chunk's store, out = base + acc (or acc), and the and of the per-(chunk, row) flags after the pass.
#pragma once

#include <cstdint>
#include <vector>

namespace fedkernels {
namespace {

// o[0:len) = b[0:len) + acc (b may be null: o = acc), in O, added in the accumulation type A.
template <typename O, typename A>
inline void store_chunk(const O* b, const A* acc, O* o, int64_t len) {
  if (b) {
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) o[j] = static_cast<O>(A(b[j]) + acc[j]);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) o[j] = static_cast<O>(acc[j]);
  }
}

// ok[i] = and over the nch chunks of flag[c * n + i] (each chunk wrote its own row flags: no shared writes).
inline void and_chunk_flags(const std::vector<unsigned char>& flag, int64_t nch, int64_t n, bool* ok) {
  for (int64_t i = 0; i < n; ++i) {
    bool all = true;
    for (int64_t c = 0; c < nch; ++c) all = all && flag[c * n + i];
    ok[i] = all;
  }
}

}  // namespace
}  // namespace fedkernels
