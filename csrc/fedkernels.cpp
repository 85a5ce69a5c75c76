// fedkernels' library block and build facts. This is the only translation unit that includes
// torch/extension.h (pybind11); the kernel files in cpu/ and cuda/ include only ATen headers.
#include <torch/extension.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <locale>

#include "lu_limits.h"

// The fedkernels library itself: its one TORCH_LIBRARY block, which claims the namespace (a second
// extension defining fedkernels:: fails at load). Each op defines its schema beside its CPU kernel,
// csrc/cpu/<op>.cpp, with TORCH_LIBRARY_FRAGMENT(fedkernels, m), and registers its CUDA kernel in
// csrc/cuda/<op>_glue.cpp; this file holds nothing per op.
TORCH_LIBRARY(fedkernels, m) {}

namespace {
// How this extension reaches libstdc++ (see fedkernels/_toolchain.py): "static" when std::locale's
// code lives in this very file (a private copy linked in by a compiler without libstdc++.so, whose
// locale is never initialised: the first C++ error message crashes), else "shared"; libstdcxx_path
// names the file that provides it. setup.py refuses to produce a "static" build.
void libstdcxx_facts(pybind11::dict& d) {
  Dl_info self{}, lib{};
  const std::locale& (*classic)() = &std::locale::classic;
  if (dladdr(reinterpret_cast<void*>(&libstdcxx_facts), &self) != 0 &&
      dladdr(reinterpret_cast<void*>(classic), &lib) != 0 && lib.dli_fname != nullptr) {
    d["libstdcxx"] = self.dli_fbase == lib.dli_fbase ? "static" : "shared";
    d["libstdcxx_path"] = lib.dli_fname;
  } else {
    d["libstdcxx"] = "unknown";
  }
}

pybind11::dict build_info() {
  pybind11::dict d;
  // The compiler command setup.py chose (its guard: $CXX, else the system compiler) and its version.
#ifdef FEDKERNELS_CXX
  d["cxx"] = FEDKERNELS_CXX;
#else
  d["cxx"] = "unknown";
#endif
  d["cxx_version"] = __VERSION__;
  libstdcxx_facts(d);
#ifdef FEDKERNELS_WITH_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
#ifdef _OPENMP
  d["openmp"] = true;
  d["openmp_version"] = _OPENMP;
#else
  d["openmp"] = false;
#endif
  d["torch_version"] = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) +
                       "." + std::to_string(TORCH_VERSION_PATCH);
#ifdef __AVX512F__
  d["simd"] = "avx512";
#elif defined(__AVX2__)
  d["simd"] = "avx2";
#else
  d["simd"] = "baseline";
#endif
#define FK_STR2(x) #x
#define FK_STR(x) FK_STR2(x)
#ifdef FEDKERNELS_MARCH_NAME
  d["march"] = FK_STR(FEDKERNELS_MARCH_NAME);
#else
  d["march"] = "unknown";
#endif
  // Which clone of the hot loops runs here (portable builds pick one per process at load time).
#if defined(FEDKERNELS_DISPATCH) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  d["simd_dispatch"] = __builtin_cpu_supports("x86-64-v4")   ? "x86-64-v4"
                       : __builtin_cpu_supports("x86-64-v3") ? "x86-64-v3"
                                                             : "default";
#else
  d["simd_dispatch"] = "none";
#endif
  // Op limits defined once in C++ and read by the Python wrappers (fedkernels.ops.lu.LU_MAX_N).
  d["lu_max_n"] = fedkernels::kLuMaxN;
  return d;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fedkernels native ops (registered under torch.ops.fedkernels)";
  m.def("build_info", &build_info,
        "Build facts: CUDA compiled, OpenMP, torch version, SIMD level, C++ compiler and libstdc++ linkage, "
        "op size limits (lu_max_n)");
}
