"""Resource guards: oversized K x d buffers and FedAWARE momentum tables are refused before allocation."""

import pytest
import torch

from fedkernels import _memory
from fedkernels.algorithms import build
from fedkernels.flat import UpdateBuffer


@pytest.fixture
def small_memory(monkeypatch):
    """Pretend only 1 MiB is available; count real allocations of big tensors."""
    monkeypatch.setattr(_memory, "available_bytes", lambda device=None: 1 << 20)
    monkeypatch.delenv("FEDKERNELS_MEMORY_GUARD", raising=False)
    return 1 << 20


def test_available_bytes_host_is_positive_and_bounded():
    a = _memory.available_bytes("cpu")
    assert a is not None and a > 0
    with open("/proc/meminfo") as f:
        total = int(next(l for l in f if l.startswith("MemTotal:")).split()[1]) * 1024
    assert a <= total


def test_update_buffer_refused_before_allocation(small_memory, monkeypatch):
    calls = []
    real_zeros = torch.zeros

    def spy(*a, **k):
        calls.append(a)
        return real_zeros(*a, **k)

    monkeypatch.setattr(torch, "zeros", spy)
    with pytest.raises(MemoryError) as ei:
        UpdateBuffer(1000, 10_000)  # 40 MB of float32 > 1 MiB
    msg = str(ei.value)
    assert "UpdateBuffer" in msg and "K=1000" in msg and "d=10000" in msg
    assert "fedkernels.streaming" in msg and "bfloat16" in msg
    assert calls == []  # nothing was allocated
    assert isinstance(ei.value, _memory.InsufficientMemoryError)


def test_update_buffer_that_fits_is_allocated(small_memory):
    b = UpdateBuffer(4, 1000)  # 16 kB
    assert b.data.shape == (4, 1000)


def test_bf16_buffer_fits_where_fp32_does_not(monkeypatch):
    monkeypatch.setattr(_memory, "available_bytes", lambda device=None: 100_000)
    with pytest.raises(MemoryError):
        UpdateBuffer(10, 5000, dtype=torch.float32)  # 200 kB
    assert UpdateBuffer(10, 4000, dtype=torch.bfloat16).data.dtype == torch.bfloat16  # 80 kB


def test_guard_can_be_disabled(small_memory, monkeypatch):
    monkeypatch.setenv("FEDKERNELS_MEMORY_GUARD", "0")
    assert UpdateBuffer(100, 10_000).data.numel() == 1_000_000


def test_unknown_availability_skips_the_check(monkeypatch):
    monkeypatch.setattr(_memory, "available_bytes", lambda device=None: None)
    _memory.check_alloc(1 << 60, "huge", "cpu")  # no error: nothing known to compare with


def test_fedaware_table_refused_before_allocation(small_memory):
    agg = build("fedaware", num_clients=500)
    g = torch.zeros(2000)  # N x d = 1e6 floats = 4 MB > 1 MiB
    U = torch.randn(3, 2000)
    with pytest.raises(MemoryError) as ei:
        agg.aggregate(g, U, [1, 1, 1], [0, 1, 2])
    msg = str(ei.value)
    assert "fedaware momentum table" in msg and "N=500" in msg and "d=2000" in msg
    assert "bfloat16" in msg and "fedkernels.streaming" in msg
    assert agg.M is None  # the table was not allocated


def test_fedaware_table_that_fits(small_memory):
    agg = build("fedaware", num_clients=5)
    new, info = agg.aggregate(torch.zeros(100), torch.randn(5, 100), [1] * 5, list(range(5)))
    assert agg.M.shape == (5, 100) and torch.isfinite(new).all()


def test_check_alloc_message_and_fraction(monkeypatch):
    monkeypatch.setattr(_memory, "available_bytes", lambda device=None: 1000)
    _memory.check_alloc(800, "x", "cpu")  # within 90 %
    with pytest.raises(_memory.InsufficientMemoryError, match=r"x needs 1000 B but only 1000 B .*try chunks"):
        _memory.check_alloc(1000, "x", "cpu", hint="try chunks")


def test_cgroup_v1_limit_is_read(tmp_path, monkeypatch):
    # a fake cgroup v1 tree: limit 1 GiB, usage 256 MiB -> 768 MiB available
    mem = tmp_path / "memory" / "grp"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text(str(1 << 30))
    (mem / "memory.usage_in_bytes").write_text(str(256 << 20))
    cg = tmp_path / "cgroup"
    cg.write_text("4:memory:/grp\n0::/\n")
    real_open = open

    def fake_open(path, *a, **k):
        path = str(path)
        if path == "/proc/self/cgroup":
            return real_open(cg, *a, **k)
        if path.startswith("/sys/fs/cgroup"):
            return real_open(str(tmp_path) + path[len("/sys/fs/cgroup") :], *a, **k)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    assert _memory._cgroup_available() == (1 << 30) - (256 << 20)
