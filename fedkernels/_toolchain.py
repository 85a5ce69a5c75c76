"""The C++ toolchain guard of the native build: the extension must use the shared libstdc++.

Why: where ``$CXX`` is a gcc wrapper whose search path has ``libstdc++.a`` but not ``libstdc++.so``
(as on a GPU image this project was built on), torch's cpp_extension, which compiles and links with
``$CXX`` (else ``c++``), gives ``_C.so`` a private static copy of libstdc++ whose locale is never
initialised, and the first C++ error message (``ostream << long`` in a csrc/<op>_checks.h rule) crashes the
process with SIGSEGV: every bad argument that reaches a C++ check kills Python.

Two checks, both used by setup.py (which loads this file by path: stdlib only, no fedkernels
import, since the package is not importable before its extension is built):

* before compiling, :func:`choose_compiler`: ``$CXX -print-file-name=libstdc++.so`` must name an
  existing file (one subprocess, milliseconds). If not, the system compiler (/usr/bin/g++ and
  /usr/bin/gcc) is used when it passes, with one line saying so; otherwise the build stops with
  one line naming the compiler and what to set.
* after linking, :func:`libstdcxx_linkage` reads the built ``.so``'s ELF: ``shared`` (a NEEDED
  ``libstdc++.so.*`` entry), ``static`` (no such entry, and the file defines libstdc++'s own
  ``std::locale`` members) or ``none`` (neither: the C++ runtime comes from torch's libraries).
  A ``static`` build is deleted and the build fails (:func:`check_extension`).

At run time ``fedkernels.build_info()`` reports ``cxx`` (the compiler the build used) and
``libstdcxx`` (whether the loaded extension's ``std::locale`` lives in the extension itself).

``python fedkernels/_toolchain.py --exports`` prints the ``export CXX=... CC=...`` line a shell
script needs (nothing when ``$CXX`` passes; exit 2 with one line when no compiler does);
``python fedkernels/_toolchain.py FILE.so`` prints a file's libstdc++ linkage.
"""

from __future__ import annotations

import os
import shlex
import struct
import subprocess
import sys
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple

SYSTEM_CXX = "/usr/bin/g++"
SYSTEM_CC = "/usr/bin/gcc"

# Mangled-name prefix of std::locale's members: only libstdc++ itself defines them.
_LIBSTDCXX_MARKER = b"_ZNSt6locale"


class ToolchainError(RuntimeError):
    """The build cannot go on with this toolchain (the message is one line)."""


class Choice(NamedTuple):
    """The compiler the build uses, the environment to set for it, and the line to print (or None)."""

    cxx: str
    env: Dict[str, str]
    note: Optional[str]


def default_cxx(environ: Mapping[str, str]) -> str:
    """The C++ compiler torch's cpp_extension uses: ``$CXX``, else ``c++``."""
    return environ.get("CXX", "").strip() or "c++"


def probe_shared_libstdcxx(cxx: str) -> Tuple[bool, str]:
    """Whether the compiler command ``cxx`` links libstdc++ as a shared library.

    Returns (True, path of its libstdc++.so) or (False, why not, as a phrase)."""
    try:
        argv = shlex.split(cxx) + ["-print-file-name=libstdc++.so"]
    except ValueError as e:
        return False, f"cannot be parsed as a command ({e})"
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"cannot be run ({type(e).__name__}: {e})"
    path = r.stdout.strip()
    if r.returncode != 0:
        return False, f"fails on -print-file-name=libstdc++.so (exit {r.returncode})"
    if os.path.isabs(path) and os.path.isfile(path):
        return True, path
    return False, (
        f"has no libstdc++.so on its search path (-print-file-name=libstdc++.so answers {path!r}), "
        f"so it links a private static libstdc++ that crashes on the first C++ error message"
    )


def choose_compiler(environ: Mapping[str, str], system: Tuple[str, str] = (SYSTEM_CXX, SYSTEM_CC)) -> Choice:
    """The compiler the build must use: ``$CXX`` (else ``c++``) when it links the shared libstdc++,
    else the system compiler ``system`` = (C++ compiler, C compiler) when that one does.

    Raises ToolchainError (one line naming the compiler and what to set) when neither does. Not on
    Linux: no check (the static-libstdc++ trap is a GNU toolchain one)."""
    cxx = default_cxx(environ)
    if not sys.platform.startswith("linux"):
        return Choice(cxx, {}, None)
    ok, why = probe_shared_libstdcxx(cxx)
    if ok:
        return Choice(cxx, {}, None)
    sys_cxx, sys_cc = system
    named = f"CXX={cxx}" if environ.get("CXX", "").strip() else f"the default C++ compiler {cxx} (CXX unset)"
    if sys_cxx != cxx and os.path.isfile(sys_cxx) and probe_shared_libstdcxx(sys_cxx)[0]:
        env = {"CXX": sys_cxx}
        if os.path.isfile(sys_cc):
            env["CC"] = sys_cc
        setting = " ".join(f"{k}={v}" for k, v in env.items())
        return Choice(sys_cxx, env, f"fedkernels build: {named} {why}; building with {setting} instead")
    raise ToolchainError(
        f"fedkernels build: {named} {why}; set CXX (and CC) to a compiler that links the shared "
        f"libstdc++, e.g. CXX={SYSTEM_CXX} CC={SYSTEM_CC} (checked with `$CXX -print-file-name=libstdc++.so`)"
    )


# ---- ELF reading (enough of the format for NEEDED entries and defined symbol names) -------------


class _Elf:
    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self.data = f.read()
        d = self.data
        if d[:4] != b"\x7fELF" or d[4] not in (1, 2) or d[5] not in (1, 2):
            raise ValueError(f"{path}: not an ELF file (expected a Linux shared library)")
        self.is64 = d[4] == 2
        self.end = "<" if d[5] == 1 else ">"
        if self.is64:
            (shoff,) = struct.unpack_from(self.end + "Q", d, 0x28)
            shentsize, shnum, shstrndx = struct.unpack_from(self.end + "HHH", d, 0x3A)
        else:
            (shoff,) = struct.unpack_from(self.end + "I", d, 0x20)
            shentsize, shnum, shstrndx = struct.unpack_from(self.end + "HHH", d, 0x2E)
        if shoff == 0 or shnum == 0:
            raise ValueError(f"{path}: ELF file without section headers")
        fmt = self.end + ("IIQQQQIIQQ" if self.is64 else "IIIIIIIIII")
        # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
        self.sections = [struct.unpack_from(fmt, d, shoff + i * shentsize) for i in range(shnum)]

    def _bytes(self, index: int) -> bytes:
        s = self.sections[index]
        return self.data[s[4] : s[4] + s[5]] if s[1] != 8 else b""  # SHT_NOBITS has no file bytes

    @staticmethod
    def _cstr(table: bytes, offset: int) -> bytes:
        end = table.find(b"\0", offset)
        return table[offset : end if end >= 0 else len(table)]

    def needed(self) -> List[str]:
        """The DT_NEEDED entries (the shared libraries the loader must open for this file)."""
        out = []
        fmt = self.end + ("qQ" if self.is64 else "iI")
        size = struct.calcsize(fmt)
        for i, s in enumerate(self.sections):
            if s[1] != 6:  # SHT_DYNAMIC
                continue
            strtab, table = self._bytes(s[6]), self._bytes(i)
            for tag, val in struct.iter_unpack(fmt, table[: len(table) - len(table) % size]):
                if tag == 0:  # DT_NULL
                    break
                if tag == 1:  # DT_NEEDED
                    out.append(self._cstr(strtab, val).decode(errors="replace"))
        return out

    def defines(self, prefix: bytes) -> bool:
        """Whether a symbol table (.symtab or .dynsym) defines a symbol whose name starts with prefix."""
        for i, s in enumerate(self.sections):
            if s[1] not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
                continue
            strtab = self._bytes(s[6])
            if prefix not in strtab:
                continue
            if self.is64:
                fmt, name_at, shndx_at = self.end + "IBBHQQ", 0, 3
            else:
                fmt, name_at, shndx_at = self.end + "IIIBBH", 0, 5
            size = struct.calcsize(fmt)
            table = self._bytes(i)
            for sym in struct.iter_unpack(fmt, table[: len(table) - len(table) % size]):
                if sym[shndx_at] != 0 and strtab.startswith(prefix, sym[name_at]):  # 0: SHN_UNDEF
                    return True
        return False


def needed_libraries(path: str) -> List[str]:
    """The NEEDED entries of an ELF shared library (what ``readelf -d`` lists as Shared library)."""
    return _Elf(path).needed()


def libstdcxx_linkage(path: str) -> str:
    """How the ELF shared library at ``path`` links libstdc++: ``shared`` (it needs libstdc++.so.*),
    ``static`` (it carries its own: it defines std::locale's members) or ``none``."""
    elf = _Elf(path)
    if any(n.startswith("libstdc++.so") for n in elf.needed()):
        return "shared"
    return "static" if elf.defines(_LIBSTDCXX_MARKER) else "none"


def check_extension(path: str, cxx: str) -> str:
    """After linking: the built extension must not carry its own libstdc++. A ``static`` file is
    deleted (it would crash on its first C++ error message) and ToolchainError raised; returns
    the linkage otherwise (``unchecked`` off Linux: no ELF, no GNU libstdc++ trap)."""
    if not sys.platform.startswith("linux"):
        return "unchecked"
    linkage = libstdcxx_linkage(path)
    if linkage == "static":
        os.remove(path)
        raise ToolchainError(
            f"fedkernels build: {path} was linked by CXX={cxx} with a private static libstdc++ (no libstdc++.so "
            f"among its NEEDED libraries), which crashes on its first C++ error message; deleted it: rebuild "
            f"with CXX={SYSTEM_CXX} CC={SYSTEM_CC} or another compiler that links the shared libstdc++"
        )
    return linkage


def _main(argv: List[str]) -> int:
    if argv == ["--exports"]:
        try:
            choice = choose_compiler(os.environ)
        except ToolchainError as e:
            print(e, file=sys.stderr)
            return 2
        if choice.note:
            print(choice.note, file=sys.stderr)
        if choice.env:
            print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in choice.env.items()))
        return 0
    if len(argv) == 1 and not argv[0].startswith("-"):
        try:
            print(libstdcxx_linkage(argv[0]))
        except (OSError, ValueError) as e:
            print(e, file=sys.stderr)
            return 2
        return 0
    print("usage: python fedkernels/_toolchain.py --exports | FILE.so", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
