// The size limit of the small dense LU ops (lu_factor, lu_solve): n <= kLuMaxN, written once here.
// Read by the CPU checks (csrc/lu_checks.h), the CUDA kernels (csrc/cuda/lu.cuh: shared-memory and
// register arrays are sized by it), and Python (build_info()["lu_max_n"] -> fedkernels.ops.lu.LU_MAX_N).
// Plain C++ (no ATen, no CUDA headers): nvcc compiles csrc/cuda/lu.cu alone with it.
#pragma once

namespace fedkernels {

constexpr int kLuMaxN = 64;  // small dense systems: FedECADO's K + 1 (K clients per round)

}  // namespace fedkernels
