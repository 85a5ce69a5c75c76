"""FlatSpec round trip on a CNN with conv, linear, bias and norm layers; UpdateBuffer."""

import pytest
import torch
from torch import nn

from fedkernels import FlatSpec, UpdateBuffer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, bias=False)
        self.gn = nn.GroupNorm(2, 6)
        self.fc1 = nn.Linear(6 * 4 * 4, 10)
        self.fc2 = nn.Linear(10, 3)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.gn(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def test_spec_records_layout():
    m = Net()
    s = FlatSpec.from_module(m, include_buffers=False)  # parameters only
    assert s.d == sum(p.numel() for p in m.parameters())
    kinds = {e.name: e.kind for e in s}
    assert kinds["conv1.weight"] == "conv" and kinds["conv1.bias"] == "vector"
    assert kinds["bn1.weight"] == "norm" and kinds["gn.bias"] == "norm"
    assert kinds["fc1.weight"] == "linear" and kinds["fc2.bias"] == "vector"
    pos = {e.name: e.layer_from_output for e in s}
    assert pos["fc2.weight"] == 0 and pos["fc2.bias"] == 0 and pos["fc1.weight"] == 1
    assert pos["conv1.weight"] == len(s.layer_modules()) - 1
    offs = [e.offset for e in s]
    assert offs == sorted(offs) and offs[0] == 0
    assert s["conv2.weight"].rows == 6 and s["conv2.weight"].fan_in == 4 * 9
    assert s.layer_modules() == ["conv1", "bn1", "conv2", "gn", "fc1", "fc2"]


def test_flatten_load_roundtrip_and_views():
    m, m2 = Net(), Net()
    s = FlatSpec.from_module(m)
    v = s.flatten(m)
    assert v.shape == (s.d,)
    s.load_(m2, v)
    for (n1, p1), (n2, p2) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), n1
    views = s.views(v)
    assert views["fc1.weight"].data_ptr() == v[s["fc1.weight"].offset :].data_ptr()  # a view, no copy
    views["fc2.bias"].fill_(7.0)
    assert torch.all(v[s["fc2.bias"].slice] == 7.0)
    x = torch.randn(2, 1, 8, 8)
    m.eval()
    m2.eval()
    assert torch.equal(m(x), m2(x))


def test_default_spec_is_the_simulators():
    """FlatSpec.from_module and the simulator agree: float buffers (BatchNorm
    running statistics) are in the flat vector by default, after the parameters."""
    from fedkernels.sim import presets
    from fedkernels.sim.config import apply_overrides
    from fedkernels.sim.simulation import Simulation

    m = Net()
    s = FlatSpec.from_module(m)
    n_par = sum(p.numel() for p in m.parameters())
    assert s.d == n_par + sum(b.numel() for b in m.buffers() if b.is_floating_point())
    assert s["bn1.running_mean"].is_buffer and s["bn1.running_mean"].offset >= n_par
    cfg = apply_overrides(
        presets.get("smoke"), ["rounds=1", "data.train_subset=100", "verbose=false", "progress=false"]
    )
    sim = Simulation(
        cfg,
        write_outputs=False,
        model_fn=lambda c, ch, size: nn.Sequential(
            nn.Flatten(), nn.Linear(ch * size * size, 8), nn.BatchNorm1d(8), nn.Linear(8, c)
        ),
    ).setup()
    ref = FlatSpec.from_module(sim.model)
    assert [(e.name, e.offset) for e in sim.spec] == [(e.name, e.offset) for e in ref] and sim.spec.d == ref.d
    assert any(e.name.endswith("running_var") for e in ref)


def test_buffers_and_bind():
    m = Net()
    s = FlatSpec.from_module(m, include_buffers=True)
    names = s.names
    assert "bn1.running_mean" in names and "bn1.num_batches_tracked" not in names
    s2 = FlatSpec.from_module(m)
    flat = torch.zeros(s2.d)
    before = s2.flatten(m).clone()
    s2.bind_(m, flat)
    assert torch.equal(flat, before)
    with torch.no_grad():
        m.fc2.bias.add_(1.0)  # writes through to the flat vector
    assert torch.equal(flat[s2["fc2.bias"].slice], before[s2["fc2.bias"].slice] + 1)


def test_masks_and_ranges():
    s = FlatSpec.from_module(Net(), include_buffers=False)  # parameters only
    head = s.mask(lambda e: e.layer_from_output == 0)
    assert int(head.sum()) == 10 * 3 + 3
    r = s.ranges(lambda e: e.module in ("fc1", "fc2"))
    assert r == [(s["fc1.weight"].offset, s.d)]


def test_bad_vectors():
    s = FlatSpec.from_module(Net())
    with pytest.raises(ValueError, match="length d="):
        s.load_(Net(), torch.zeros(s.d + 1))
    with pytest.raises(ValueError, match="length d="):
        s.views(torch.zeros(3, 3))


def test_update_buffer_rows_in_place():
    m = Net()
    s = FlatSpec.from_module(m, include_buffers=False)  # parameters only (all moved by 0.5)
    g = s.flatten(m).clone()
    buf = UpdateBuffer(3, s)
    slot = buf.add(client_id=5, num_examples=12)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.5)
    r = buf.write_delta(slot, m, g)
    assert r.data_ptr() == buf.data.data_ptr()
    assert torch.allclose(buf.matrix()[0], torch.full((s.d,), 0.5), atol=1e-6)
    assert buf.matrix().shape == (1, s.d) and buf.client_ids == [5]
    buf.add(6)
    buf.add(7)
    with pytest.raises(ValueError, match="all K=3 rows"):
        buf.add(8)
    buf.reset()
    assert buf.count == 0
    with pytest.raises(ValueError, match="K must be a positive int"):
        UpdateBuffer(0, s)


@pytest.mark.parametrize(
    "dtype,d",
    [(torch.float32, 7), (torch.bfloat16, 11), (torch.float16, 4099), (torch.float64, 1), (torch.float32, 1024)],
)
def test_update_buffer_rows_are_16_byte_aligned(dtype, d):
    """Padded row stride (16 bytes, 128 for long rows): every row starts aligned for the CUDA kernels'
    vector path; the view is [K, d] and the ops read it like a dense matrix."""
    from fedkernels import ops, reference

    buf = UpdateBuffer(5, d, dtype=dtype)
    U = buf.data
    es = U.element_size()
    assert U.shape == (5, d) and U.stride(1) == 1 and U.stride(0) >= d
    assert (U.stride(0) * es) % 16 == 0 and U.data_ptr() % 16 == 0
    if d * es >= 4096:
        assert (U.stride(0) * es) % 128 == 0
    assert U.stride(0) * es - d * es < (128 if d * es >= 4096 else 16)  # no more padding than needed
    U.copy_(torch.randn(5, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64).to(dtype))
    coef = torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5], dtype=torch.float64)
    torch.testing.assert_close(
        ops.weighted_sum(U, coef).double(), reference.weighted_sum(U, coef), rtol=2e-2, atol=2e-2
    )
    torch.testing.assert_close(ops.gram(U), reference.gram(U), rtol=1e-11, atol=1e-11 * d)
