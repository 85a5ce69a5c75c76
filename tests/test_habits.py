"""Habits of the repository, checked on its tracked files:

* comments and docstrings explain the code, not its history: no issue reference (a hash sign and two
  to four digits, or "issue" and a number), no ISO date and no commit hash in a comment of the code
  (fedkernels/, csrc/, bench/, tests/, examples/, .ci/, results/'s scripts, Makefile, setup.py,
  pyproject.toml); history belongs in git. Only comments and docstrings are read (a hex constant, a
  seed or a regex in the code is not a comment), URLs are skipped, and the few comments that must name
  a date or hash are listed in ``ALLOWED`` with the reason. Documents (``*.md``) may date a measurement
  and are not checked here.
* nothing in the repository points outside it: no tracked text file names ``../shared`` or ``/work/``.

Needs a git checkout (the tracked files come from ``git ls-files``); skipped elsewhere (an sdist).
"""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CODE_DIRS = ("fedkernels/", "csrc/", "bench/", "tests/", "examples/", ".ci/", "results/")
CODE_FILES = ("Makefile", "setup.py", "pyproject.toml", "MANIFEST.in")
C_LIKE = (".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh")
HASH_COMMENTED = (".sh", ".toml", ".cfg", ".yaml", ".yml", ".in", ".txt")
# data files are not code: their contents are not comments
SKIP_EXT = (".json", ".jsonl", ".md", ".csv", ".npz", ".npy", ".pt", ".png", ".pdf", ".svg", ".xz", ".gz")

ISSUE = re.compile(r"(?<![\w&$])#\d{2,4}\b(?![0-9a-fA-F])|\b[Ii]ssues? #?\d+\b")
DATE = re.compile(r"\b20\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")
# 7-40 lower-case hex digits with at least one letter and one digit, not part of a longer word, a
# number (1.5e10), or a 0x literal
HASH = re.compile(r"(?<![\w.+-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w.])")
URL = re.compile(r"\b(?:https?://|github\.com/|www\.)\S+")

# (path, text in the comment) -> why it may stay. Keep this list short and precise.
ALLOWED: dict = {}

# the strings item 2 forbids, spelled so that this file does not contain them
OUTSIDE = ("../" + "shared", "/" + "work/")


def _tracked():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = [f for f in out.stdout.decode().split("\0") if f]
    if not files:
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [f for f in files if os.path.isfile(os.path.join(ROOT, f))]


def _code_files():
    for f in _tracked():
        if f.endswith(SKIP_EXT) or not (f.startswith(CODE_DIRS) or f in CODE_FILES):
            continue
        yield f


# ---- comments of each language: (line, text) -------------------------------------------------------------
def python_comments(src: str):
    """The comments (tokenize) and docstrings (ast: module, class, function) of Python source."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string
    except (tokenize.TokenError, SyntaxError):
        pass
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                yield body[0].lineno, body[0].value.value


def c_comments(src: str):
    """``//`` and ``/* */`` comments of C, C++ and CUDA source (string and char literals skipped)."""
    i, n, line = 0, len(src), 1
    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            yield line, src[i:j]
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            yield line, src[i:j]
            line += src.count("\n", i, j)
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and (src[i - 1].isalnum()):  # a digit separator (1'000), not a char
                i += 1
                continue
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            i = j + 1
        else:
            i += 1


def hash_comments(src: str):
    """``#`` comments of shell, make and TOML-like files: from a ``#`` at the start of a line or after a
    blank that is outside quotes, to the end of the line."""
    for k, ln in enumerate(src.splitlines(), 1):
        quote = None
        for i, c in enumerate(ln):
            if quote:
                if c == quote:
                    quote = None
            elif c in "\"'":
                quote = c
            elif c == "#" and (i == 0 or ln[i - 1] in " \t"):
                if not ln.startswith("#!"):
                    yield k, ln[i:]
                break


def comments_of(path: str, src: str):
    if path.endswith(".py"):
        return python_comments(src)
    if path.endswith(C_LIKE):
        return c_comments(src)
    if (
        path.endswith(HASH_COMMENTED)
        or os.path.basename(path) in ("Makefile", "run")
        or "." not in os.path.basename(path)
    ):
        return hash_comments(src)
    return iter(())


def history_in(text: str):
    """The issue references, dates and commit hashes in one comment."""
    text = URL.sub(" ", text)
    return [m.group(0) for rx in (ISSUE, DATE, HASH) for m in rx.finditer(text)]


# ---- the checks ---------------------------------------------------------------------------------------------
def test_the_finders_see_what_they_should():
    """The finders catch each kind of history and leave code-like text alone."""
    assert history_in("the kernel before issue #28") == ["issue #28"]
    assert history_in("#28: screened once") == ["#28"]
    assert history_in("(issue 15 item 6)") == ["issue 15"]
    assert history_in("measured 2026-11-25 at d1cfea2") == ["2026-11-25", "d1cfea2"]
    assert history_in("see 3e5c61f0123456789abcdef0123456789abcdef0") == ["3e5c61f0123456789abcdef0123456789abcdef0"]
    for clean in (
        "0x9E3779B97F4A7C15 and 0xd2511f53",
        "colour #ff8800, #a0a0a0",
        "1.0e-12, 1e300, 6.93147180369123816490e-01",
        "12345678 columns",
        "decade deadbeef facade",
        "https://github.com/x/y/commit/d1cfea2abc",
        "K = 16, d = 11,220,132",
        "#1 and #9",
        "sha256 of the file",
    ):
        assert history_in(clean) == [], clean
    py = '"""Doc (issue 18)."""\nx = "#28 2026-01-01"  # a date 2026-02-03\ndef f():\n    """d1cfea2"""\n'
    assert sorted(t for _, c in python_comments(py) for t in history_in(c)) == ["2026-02-03", "d1cfea2", "issue 18"]
    c = 'auto s = "#28 // 2026-01-01"; // issue #30\n/* 2026-03-04\n */ int k = 0x9e3779b9; char q = \'"\';\n// ok\n'
    got = [(ln, t) for ln, txt in c_comments(c) for t in history_in(txt)]
    assert got == [(1, "issue #30"), (2, "2026-03-04")]
    sh = 'echo "#28 # 2026-01-01"  # run 2026-05-06\nA=1 # issue 7\n#!/bin/x\n'
    assert [(ln, t) for ln, txt in hash_comments(sh) for t in history_in(txt)] == [(1, "2026-05-06"), (2, "issue 7")]


def test_code_comments_carry_no_history():
    bad = []
    for f in _code_files():
        try:
            with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
                src = fh.read()
        except UnicodeDecodeError:
            continue
        for line, text in comments_of(f, src):
            for hit in history_in(text):
                if any(p == f and s in text for (p, s) in ALLOWED):
                    continue
                bad.append(f"{f}:{line}: {hit!r} in {text.strip()[:100]!r}")
    assert not bad, (
        "comments should say what the code does and why, not its history (issue numbers, dates and "
        "commit hashes belong in git):\n" + "\n".join(bad)
    )


def test_no_tracked_file_points_outside_the_repository():
    me = os.path.relpath(os.path.abspath(__file__), ROOT)
    bad = []
    for f in _tracked():
        if f == me:
            continue
        with open(os.path.join(ROOT, f), "rb") as fh:
            data = fh.read()
        if b"\0" in data[:8192]:  # binary (archives, figures): not text a reader follows
            continue
        for k, ln in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            for s in OUTSIDE:
                if s in ln:
                    bad.append(f"{f}:{k}: {ln.strip()[:120]}")
    assert not bad, "paths outside the repository (bring what is needed in, e.g. docs/design.md):\n" + "\n".join(bad)
