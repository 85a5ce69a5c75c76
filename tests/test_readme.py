"""The documentation runs as written: README.md, docs/*.md and bench/README.md.

Python blocks are found by their ```python fence, so blocks added later are run too. Each block runs
in a fresh interpreter (cwd: a temporary directory) after PRELUDE, which defines the small objects a
snippet may name without creating them (`model`, `client_model`, `K`, `N`, ...). A block can opt out
only with the marker ``<!-- readme-test: skip: <why it cannot run offline> -->`` on the line
before its fence; the test then reports it as skipped with that reason. A block that imports an
optional framework that is not installed (flwr) is skipped, saying so.

Besides: every `fedkernels ...` command line in a shell block parses with the real CLI parser and
names presets, methods and benchmark suites that exist; every relative link points to a file (and
heading) that exists; the README stays a newcomer's page (at most ~200 lines)."""

import glob
import os
import re
import shlex
import sys
import textwrap

import pytest

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = (
    ["README.md"]
    + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    + ["bench/README.md"]
)
SKIP_MARKER = re.compile(r"<!--\s*readme-test:\s*skip:\s*(?P<why>\S.*?)\s*-->")
OPTIONAL = ("flwr", "peft")
README_MAX_LINES = 210

# Names README snippets use as "your" objects: a small model and a client's locally trained copy.
PRELUDE = textwrap.dedent("""
    import copy
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    client_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in client_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    K, N = 4, 10                      # clients per round, clients in total
    client_id, num_examples = 3, 120  # one client's id and sample count
""")


def _lines(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read().splitlines()


def fenced_blocks(doc, lang):
    """(first line number, code, skip reason or None) of every ```<lang> block of ``doc``
    (lang "" : the bare ``` blocks, which hold shell commands)."""
    lines = _lines(doc)
    opener = re.compile(r"^\s*```\s*" + re.escape(lang) + r"\s*$")
    blocks, i = [], 0
    while i < len(lines):
        if re.match(r"^\s*```", lines[i]):
            start, body = i + 1, []
            j = i + 1
            while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
                body.append(lines[j])
                j += 1
            assert j < len(lines), f"{doc}:{i + 1}: unterminated ``` block"
            if opener.match(lines[i]):
                prev = lines[i - 1] if i > 0 else ""
                m = SKIP_MARKER.search(prev)
                blocks.append((start + 1, textwrap.dedent("\n".join(body)), m.group("why") if m else None))
            i = j
        i += 1
    return blocks


BLOCKS = [(doc, line, code, why) for doc in DOCS for line, code, why in fenced_blocks(doc, "python")]


def test_docs_exist_and_readme_is_short():
    assert {"docs/install.md", "docs/simulator.md", "docs/gpu.md", "docs/library.md"} <= set(DOCS)
    n = len(_lines("README.md"))
    assert n <= README_MAX_LINES, f"README.md has {n} lines; a newcomer's page holds <= ~200: move detail to docs/"


def test_docs_have_python_blocks():
    readme = [b for b in BLOCKS if b[0] == "README.md"]
    assert len(readme) >= 2, "README.md lost its Python examples"
    assert sum(why is None for *_, why in BLOCKS) >= 3, "most documentation blocks must run"


@pytest.mark.parametrize("doc,line,code,why", BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in BLOCKS])
def test_doc_block_runs(doc, line, code, why, tmp_path):
    if why is not None:
        pytest.skip(f"{doc}:{line} opted out of this test: {why}")
    script = tmp_path / "block.py"
    script.write_text(PRELUDE + "\n# ---- %s line %d ----\n" % (doc, line) + code + "\n")
    env = dict(
        os.environ,
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        FEDKERNELS_CACHE="off",
    )
    r = cli_process.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    if r.returncode != 0:
        missing = re.search(r"No module named '([\w.]+)'", r.stderr)
        if missing and missing.group(1).split(".")[0] in OPTIONAL:
            pytest.skip(f"{doc}:{line} needs the optional {missing.group(1)} (not installed)")
    assert r.returncode == 0, f"{doc}:{line} failed:\n{code}\n---- stderr ----\n{r.stderr[-3000:]}"


def _cli_lines():
    """Every `fedkernels ...` command of the shell blocks: (doc, line number, argv after 'fedkernels')."""
    out = []
    for doc in DOCS:
        for start, code, _ in fenced_blocks(doc, ""):
            for k, raw in enumerate(code.splitlines()):
                cmd = raw.split("#", 1)[0].strip()
                cmd = re.sub(r"^\.venv/bin/", "", cmd)
                if cmd.startswith("fedkernels "):
                    out.append((doc, start + k, shlex.split(cmd)[1:]))
    return out


CLI_LINES = _cli_lines()


def test_docs_show_the_cli():
    assert sum(doc == "README.md" for doc, _, _ in CLI_LINES) >= 5, "README.md lost its command-line examples"


@pytest.mark.parametrize("doc,line,argv", CLI_LINES, ids=[f"{c[0]}:{c[1]}" for c in CLI_LINES])
def test_doc_command_line_is_valid(doc, line, argv):
    """The command parses as the CLI parses it, and what it names (preset, method, suite) exists."""
    from fedkernels.sim import presets
    from fedkernels.sim.cli import build_parser

    where = f"{doc}:{line}: fedkernels {' '.join(argv)}"
    try:
        a, rest = build_parser().parse_known_args(argv)
    except SystemExit as e:
        assert e.code == 0 and "--help" in argv, f"{where}: the CLI rejects it (exit {e.code})"
        return
    if a.cmd in ("run", "compare"):
        assert not [x for x in rest if x.startswith("-")], f"{where}: unknown options {rest}"
    preset = getattr(a, "preset", None)
    if preset is not None:
        assert preset in presets.names(), f"{where}: no preset {preset!r}"
        labels = presets.variants(preset)
        for m in [getattr(a, "method", None)] + (a.methods.split(",") if getattr(a, "methods", None) else []):
            if m is not None:
                from fedkernels import algorithms

                name = m.split(":", 1)[0]
                assert name in labels or name in algorithms.available(), f"{where}: {preset} has no method {m!r}"
    if a.cmd == "bench":
        assert os.path.isfile(os.path.join(ROOT, "bench", f"{a.suite}.py")), where


def _links():
    out = []
    for doc in DOCS:
        for n, text in enumerate(_lines(doc), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", text):
                if not re.match(r"^[a-z]+://", target):
                    out.append((doc, n, target))
    return out


def _anchors(path):
    """GitHub's heading anchors of a Markdown file."""
    with open(path, encoding="utf-8") as f:
        heads = [m.group(1) for m in re.finditer(r"^#+\s+(.*)$", f.read(), re.M)]
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_resolve():
    links = _links()
    assert len(links) >= 10
    bad = []
    for doc, n, target in links:
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path)) if path else os.path.join(ROOT, doc)
        if not os.path.exists(full):
            bad.append(f"{doc}:{n}: {target} (no such file)")
        elif anchor and anchor not in _anchors(full):
            bad.append(f"{doc}:{n}: {target} (no heading #{anchor})")
    assert not bad, "\n".join(bad)
