"""Safe loading: checksummed atomic checkpoints, weights_only unpickling, yaml.safe_load configs."""

import hashlib
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch

from fedkernels import safe_io
from fedkernels.safe_io import CheckpointError, ConfigError, load_checkpoint, load_config, save_checkpoint

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter


class _Evil:
    """Unpickling this would create the marker file (a classic __reduce__ gadget)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _wrap(payload: bytes) -> bytes:
    """A file with a VALID header and checksum around an arbitrary payload."""
    return safe_io.MAGIC + f"{hashlib.sha256(payload).hexdigest()} {len(payload)}\n".encode() + payload


def test_roundtrip(tmp_path):
    st = {
        "round": 3,
        "params": torch.arange(10.0),
        "nested": {"ids": [1, 2], "m": torch.ones(2, 3).bfloat16()},
        "none": None,
        "name": "fedavg",
    }
    p = save_checkpoint(st, tmp_path / "c.pt")
    out = load_checkpoint(p)
    assert out["round"] == 3 and out["name"] == "fedavg" and out["none"] is None
    assert torch.equal(out["params"], st["params"]) and out["nested"]["m"].dtype == torch.bfloat16
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]  # no temp file left


@pytest.mark.parametrize("wrap", [True, False])
def test_code_carrying_pickle_is_rejected_and_never_runs(tmp_path, wrap):
    marker = tmp_path / "PWNED"
    buf = io.BytesIO()
    torch.save({"params": torch.zeros(2), "x": _Evil(str(marker))}, buf)  # a torch-format evil file
    assert not marker.exists()
    path = tmp_path / "evil.pt"
    path.write_bytes(_wrap(buf.getvalue()) if wrap else buf.getvalue())
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(path)
    assert not marker.exists()
    assert ("cannot unpickle" in str(ei.value)) if wrap else ("not a fedkernels checkpoint" in str(ei.value))


def test_raw_pickle_gadget_is_rejected(tmp_path):
    marker = tmp_path / "PWNED2"
    path = tmp_path / "evil2.pt"
    path.write_bytes(_wrap(pickle.dumps(_Evil(str(marker)))))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    assert not marker.exists()


def test_truncated_file_is_detected(tmp_path):
    p = save_checkpoint({"w": torch.randn(1000)}, tmp_path / "t.pt")
    data = open(p, "rb").read()
    for cut in (len(data) - 1, len(data) // 2, len(safe_io.MAGIC) + 3, 5, 0):
        open(p, "wb").write(data[:cut])
        with pytest.raises(CheckpointError, match="truncated|corrupted|not a fedkernels"):
            load_checkpoint(p)


def test_corrupted_byte_is_detected(tmp_path):
    p = save_checkpoint({"w": torch.randn(1000)}, tmp_path / "x.pt")
    data = bytearray(open(p, "rb").read())
    data[-100] ^= 0x01
    open(p, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(p)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "nope.pt")


def test_atomic_save_keeps_old_file_when_killed_mid_write(tmp_path):
    """SIGKILL during save: the previous checkpoint stays loadable (temp file + os.replace)."""
    p = tmp_path / "a.pt"
    save_checkpoint({"v": 1, "w": torch.zeros(3)}, p)
    code = (
        "import os, sys, torch\n"
        "from fedkernels.sim import checkpoint as ck\n"
        "real = os.fsync\n"
        "def die(fd):\n"
        "    os.kill(os.getpid(), 9)\n"
        "os.fsync = die\n"
        f"ck.save({str(p)!r}, {{'v': 2, 'w': torch.ones(10**6)}})\n"
    )
    r = cli_process.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == -9
    assert load_checkpoint(p)["v"] == 1


def test_load_config_safe(tmp_path):
    good = tmp_path / "c.yaml"
    good.write_text("method: fedavg\nrounds: 3\nopts: {mu: 0.1}\n")
    assert load_config(good) == {"method": "fedavg", "rounds": 3, "opts": {"mu": 0.1}}
    marker = tmp_path / "YAMLPWNED"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f"x: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(evil)
    assert not marker.exists()
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml") == {}


def test_safe_io_sits_below_the_simulator():
    """fedkernels.safe_io imports nothing from fedkernels.sim (the simulator uses it, not the reverse)."""
    code = (
        "import sys, fedkernels.safe_io\n"
        "bad = sorted(m for m in sys.modules if m.startswith('fedkernels.sim'))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_checkpoint_opens_with_plain_torch_load(tmp_path):
    """A checkpoint is a torch.save archive a user opens with torch.load as it is."""
    st = {"round": 2, "global": torch.randn(7), "aggregator": {"c": torch.ones(3)}}
    p = save_checkpoint(st, tmp_path / "c.pt")
    plain = torch.load(p, weights_only=True)
    assert plain["round"] == 2 and torch.equal(plain["global"], st["global"])
    raw = open(p, "rb").read()
    assert raw.startswith(b"PK") and raw.splitlines()[-1].startswith(safe_io.TRAILER)


def test_first_format_files_still_load(tmp_path):
    buf = io.BytesIO()
    torch.save({"round": 1, "w": torch.arange(3.0)}, buf)
    (tmp_path / "old.pt").write_bytes(_wrap(buf.getvalue()))
    assert torch.equal(load_checkpoint(tmp_path / "old.pt")["w"], torch.arange(3.0))
