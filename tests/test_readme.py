"""Every Python code block of README.md runs as written.

Blocks are found by their ```python fence, so blocks added later are run too. Each block runs in a
fresh interpreter (cwd: a temporary directory) after PRELUDE, which defines the small objects a
snippet may name without creating them (`model`, `client_model`, `K`, `N`, ...). A block can opt out
only with the marker ``<!-- readme-test: skip: <why it cannot run offline> -->`` on the line
before its fence; the test then reports it as skipped with that reason. A block that imports an
optional framework that is not installed (flwr) is skipped, saying so."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
SKIP_MARKER = re.compile(r"<!--\s*readme-test:\s*skip:\s*(?P<why>\S.*?)\s*-->")
OPTIONAL = ("flwr",)

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


def readme_blocks():
    """(first line number, code, skip reason or None) of every ```python block in README.md."""
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if re.match(r"^\s*```\s*python\s*$", lines[i]):
            start, body = i + 1, []
            j = i + 1
            while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
                body.append(lines[j])
                j += 1
            assert j < len(lines), f"README.md:{i + 1}: unterminated ```python block"
            prev = lines[i - 1] if i > 0 else ""
            m = SKIP_MARKER.search(prev)
            blocks.append((start + 1, textwrap.dedent("\n".join(body)), m.group("why") if m else None))
            i = j
        i += 1
    return blocks


BLOCKS = readme_blocks()


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2, "README.md lost its Python examples"
    assert sum(why is None for _, _, why in BLOCKS) >= 2, "most README blocks must run"


@pytest.mark.parametrize("line,code,why", BLOCKS, ids=[f"README.md:{b[0]}" for b in BLOCKS])
def test_readme_block_runs(line, code, why, tmp_path):
    if why is not None:
        pytest.skip(f"README.md:{line} opted out of this test: {why}")
    script = tmp_path / "block.py"
    script.write_text(PRELUDE + "\n# ---- README.md line %d ----\n" % line + code + "\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=600)
    if r.returncode != 0:
        missing = re.search(r"No module named '([\w.]+)'", r.stderr)
        if missing and missing.group(1).split(".")[0] in OPTIONAL:
            pytest.skip(f"README.md:{line} needs the optional {missing.group(1)} (not installed)")
    assert r.returncode == 0, f"README.md:{line} failed:\n{code}\n---- stderr ----\n{r.stderr[-3000:]}"
