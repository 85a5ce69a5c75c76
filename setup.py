"""Build of fedkernels._C: the CPU kernels always, the CUDA kernels when torch has CUDA
and nvcc is present (or FORCE_CUDA=1). The C++ compiler must link the shared libstdc++: checked
before compiling and after linking (fedkernels/_toolchain.py says why and how)."""

import glob
import importlib.util
import json
import os
import shutil
import sys

from setuptools import setup

try:
    import torch
except ImportError:  # an isolated build (plain `pip install .`) has no torch: fedkernels names none
    raise SystemExit(
        "fedkernels is compiled against the torch you run it with: install torch first "
        "(e.g. pip install torch==2.13.0), then pip install --no-build-isolation ."
    )
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_toolchain():
    """fedkernels/_toolchain.py by path (stdlib only): the package is not importable before it is built."""
    path = os.path.join(ROOT, "fedkernels", "_toolchain.py")
    spec = importlib.util.spec_from_file_location("_fedkernels_toolchain", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


toolchain = _load_toolchain()


def _want_cuda() -> bool:
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True
    if os.environ.get("FEDKERNELS_NO_CUDA", "0") == "1":
        return False
    return (
        torch.version.cuda is not None
        and torch.cuda.is_available()
        and CUDA_HOME is not None
        and shutil.which("nvcc") is not None
    )


def _cxx_std() -> str:
    """The C++ standard of the torch headers built against: C++20 from torch 2.14, else C++17."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def _ext():
    rel = lambda paths: sorted(os.path.relpath(p, ROOT) for p in paths)
    sources = ["csrc/fedkernels.cpp"] + rel(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    # Headers (rebuild triggers; the sdist ships them through MANIFEST.in's `graft csrc`): csrc/<op>_checks.h
    # (argument rules shared by the CPU kernels and the CUDA glue), csrc/cpu/common.h, csrc/cuda/*.h/.cuh.
    depends = rel(
        glob.glob(os.path.join(ROOT, "csrc", "*.h"))
        + glob.glob(os.path.join(ROOT, "csrc", "*", "*.h"))
        + glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cuh"))
    )
    # -fno-math-errno: sqrt need not set errno (nothing reads it), so a loop with a sqrt vectorises
    # (server_opt_step: without it GCC keeps a scalar sqrt and a library call for negative arguments)
    cxx = ["-O3", "-g0", "-fopenmp", f"-std={_cxx_std()}", "-ffp-contract=fast", "-fno-math-errno"]
    # A source build (make, pip install -e .) runs where it is built: tuned for this CPU. A wheel for
    # other machines: FEDKERNELS_MARCH=x86-64-v2 python -m build --no-isolation, a portable baseline
    # whose hot loops are also compiled for AVX2 and AVX-512 and picked at load time (FEDKERNELS_DISPATCH,
    # see csrc/cpu/common.h). build_info() reports the -march and the torch version the build used.
    march = os.environ.get("FEDKERNELS_MARCH", "native").strip()
    if march and not all(c.isalnum() or c in "-_." for c in march):
        raise SystemExit(f"FEDKERNELS_MARCH={march!r}: expected a gcc -march value such as native or x86-64-v2")
    if march:
        cxx.append(f"-march={march}")
    macros = [("FEDKERNELS_MARCH_NAME", march or "default")]
    if march != "native":
        macros.append(("FEDKERNELS_DISPATCH", "1"))
        cxx.append("-Wno-psabi")  # wide-vector helpers are always inlined into their per-ISA callers
    link = ["-fopenmp"]
    if _want_cuda():
        # csrc/cuda/<op>.cu: kernels (nvcc); csrc/cuda/<op>_glue.cpp: that op's torch glue (host
        # compiler), which registers itself under TORCH_LIBRARY_IMPL(fedkernels, CUDA, m).
        sources += rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
        sources += rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*_glue.cpp")))
        nvcc = ["-O3", f"-std={_cxx_std()}", "--expt-relaxed-constexpr", "-lineinfo"]
        return CUDAExtension(
            "fedkernels._C",
            sources,
            define_macros=macros + [("FEDKERNELS_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=link,
            depends=depends,
        )
    return CppExtension(
        "fedkernels._C",
        sources,
        define_macros=macros,
        extra_compile_args={"cxx": cxx},
        extra_link_args=link,
        depends=depends,
    )


class GuardedBuildExt(BuildExtension):
    """torch's BuildExtension behind the libstdc++ guard: the compiler is chosen (``$CXX``, else the
    system compiler, else one line and exit) before anything is compiled, and the linked ``.so`` is
    checked for a private static libstdc++ before setuptools copies it into the package."""

    def run(self):
        try:
            choice = toolchain.choose_compiler(os.environ)
        except toolchain.ToolchainError as e:
            raise SystemExit(str(e))
        if choice.note:
            print(choice.note, file=sys.stderr, flush=True)
        os.environ.update(choice.env)  # read by torch's ninja file (compile) and setuptools (link)
        self.fedkernels_cxx = choice.cxx
        for ext in self.extensions:  # build_info()["cxx"]
            ext.define_macros = [m for m in ext.define_macros if m[0] != "FEDKERNELS_CXX"] + [
                ("FEDKERNELS_CXX", json.dumps(choice.cxx))
            ]
        super().run()

    def build_extension(self, ext):
        super().build_extension(ext)
        try:
            toolchain.check_extension(self.get_ext_fullpath(ext.name), self.fedkernels_cxx)
        except toolchain.ToolchainError as e:
            raise SystemExit(str(e))


setup(ext_modules=[_ext()], cmdclass={"build_ext": GuardedBuildExt.with_options(use_ninja=True)})
