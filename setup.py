"""Build of fedkernels._C: the CPU kernels always, the CUDA kernels when torch has CUDA
and nvcc is present (or FORCE_CUDA=1)."""
import glob
import os
import shutil

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True
    if os.environ.get("FEDKERNELS_NO_CUDA", "0") == "1":
        return False
    return torch.version.cuda is not None and torch.cuda.is_available() and CUDA_HOME is not None \
        and shutil.which("nvcc") is not None


def _cxx_std() -> str:
    """The C++ standard of the torch headers built against: C++20 from torch 2.14, else C++17."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def _ext():
    rel = lambda paths: sorted(os.path.relpath(p, ROOT) for p in paths)
    sources = ["csrc/fedkernels.cpp"] + rel(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    cxx = ["-O3", "-g0", "-fopenmp", f"-std={_cxx_std()}", "-ffp-contract=fast"]
    # The extension is built where it runs (editable/source install), so tune for this CPU unless
    # FEDKERNELS_MARCH says otherwise (e.g. FEDKERNELS_MARCH=x86-64-v3 for a portable wheel, or "").
    march = os.environ.get("FEDKERNELS_MARCH", "native")
    if march:
        cxx.append(f"-march={march}")
    link = ["-fopenmp"]
    if _want_cuda():
        # csrc/cuda/<op>.cu: kernels (nvcc); csrc/cuda/<op>_glue.cpp: that op's torch glue (host
        # compiler), which registers itself under TORCH_LIBRARY_IMPL(fedkernels, CUDA, m).
        sources += rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
        sources += rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*_glue.cpp")))
        nvcc = ["-O3", f"-std={_cxx_std()}", "--expt-relaxed-constexpr", "-lineinfo"]
        return CUDAExtension("fedkernels._C", sources,
                             define_macros=[("FEDKERNELS_WITH_CUDA", "1")],
                             extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                             extra_link_args=link)
    return CppExtension("fedkernels._C", sources,
                        extra_compile_args={"cxx": cxx}, extra_link_args=link)


setup(ext_modules=[_ext()], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
