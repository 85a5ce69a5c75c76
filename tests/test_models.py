"""The specs' models: parameter counts against the numbers the specs state, shapes, layouts."""

import pytest
import torch
from torch import nn

from fedkernels.flat import FlatSpec
from fedkernels.sim.models import MODELS, build_model, count_params

# (name, num_classes, in_channels, input_size, params stated in the spec, where)
SPEC_COUNTS = [
    ("fedavg_cnn", 10, 1, 28, 1_663_370, "kuramoto_fedavg.md §6 FedAvgNetMNIST"),
    ("fedavg_cnn", 10, 3, 32, 2_156_490, "gcfed.md §5.3 CNN (CIFAR-10)"),
    ("vgg11_cifar", 10, 3, 32, 9_750_922, "kuramoto_fedavg.md §6 / fedecado.md §6.2 VGG-11"),
    ("vgg11", 100, 3, 32, 129_176_036, "gcfed.md §5.3 VGG11 (CIFAR-100)"),
    ("resnet18_gn", 100, 3, 32, 11_220_132, "fedaware.md §6 / gcfed.md §5.3 ResNet18-GN"),
    ("toy_cifar", 10, 3, 32, 122_570, "fedaware.md §6 ToyCifarNet"),
    ("lenet5", 10, 1, 28, 44_426, "fedpgvc.md §6 LeNet-5 [REC]"),
    ("lenet5", 100, 3, 32, 69_656, "fedpgvc.md §6 CIFAR-100 5-layer CNN"),
    ("lenet_keras", 10, 1, 28, 164_116, "fedpgvc.md §6 code LeNet"),
    ("mlp", 10, 1, 28, 199_210, "fedaware.md §8 MLP(784, 200, 200, 10)"),
    ("mlp_gcfed", 62, 1, 28, 549_182, "gcfed.md §5.3 MLP (EMNIST)"),
    ("mlp_pgvc", 10, 1, 8, 6_570, "fedpgvc.md §8 MLP 64-64-32-10"),
]
# counts the specs give only approximately (or not at all): the value is from the spec's layer list
OUR_COUNTS = [
    ("resnet34_gn", 100, 3, 32, 21_328_292),  # fedecado.md §6.2: "about 21.3M"
    ("small_cnn", 10, 1, 28, 18_378),  # fedecado.md §8 E3: "about 21k" (layer list: 18,378)
    ("digit_cnn", 10, 1, 8, 22_154),  # gcfed.md §8 DigitCNN
    ("digit_cnn_pgvc", 10, 1, 8, 7_510),  # fedpgvc.md §8 8x8 CNN analogue
    ("digit_mlp", 10, 1, 8, 17_226),  # gcfed.md §8 DigitMLP 64-128-64-10
    ("mlp_digits", 10, 1, 8, 9_610),  # kuramoto.md §8 KR-2 MLP 64-128-10
]
# shape-checked on the meta device (no 0.5 GB allocation, no slow CPU forward)
BIG = {"vgg11", "resnet34_gn"}


def _build(name, c, ic, s, **kw):
    if name in BIG or s > 32:
        with torch.device("meta"):
            return build_model(name, c, ic, s, **kw)
    return build_model(name, c, ic, s, **kw)


@pytest.mark.parametrize("name,c,ic,s,expected,where", SPEC_COUNTS, ids=[f"{r[0]}-{r[1]}" for r in SPEC_COUNTS])
def test_param_count_matches_spec(name, c, ic, s, expected, where):
    with torch.device("meta"):
        m = build_model(name, c, ic, s)
    assert count_params(m) == expected, where


@pytest.mark.parametrize("name,c,ic,s,expected", OUR_COUNTS, ids=[r[0] for r in OUR_COUNTS])
def test_param_count_ours(name, c, ic, s, expected):
    with torch.device("meta"):
        m = build_model(name, c, ic, s)
    assert count_params(m) == expected


def test_logreg_fedecado():
    m = build_model("logreg", 10, in_features=60)
    assert count_params(m) == 610
    assert m(torch.randn(3, 60)).shape == (3, 10)


FORWARD = [(r[0], r[1], r[2], r[3]) for r in SPEC_COUNTS + OUR_COUNTS] + [
    ("resnet18_gn", 200, 3, 64),
    ("fedavg_cnn", 10, 1, 8),
    ("lenet5", 10, 1, 32),
    ("mlp_digits", 10, 1, 8),
    ("toy_cifar", 10, 3, 28),
]


@pytest.mark.parametrize("name,c,ic,s", FORWARD, ids=[f"{r[0]}-{r[1]}-{r[3]}" for r in FORWARD])
def test_forward_shape(name, c, ic, s):
    m = _build(name, c, ic, s)
    dev = "meta" if name in BIG or s > 32 else "cpu"
    x = torch.randn(1, ic, s, s, device=dev)
    out = m(x)
    assert out.shape == (1, c)
    if dev == "cpu":
        assert torch.isfinite(out).all()


def test_every_registered_model_builds_and_runs():
    for name in MODELS:
        if name in BIG or name.startswith("resnet") or name.startswith("vgg"):
            continue
        s = 8 if "digit" in name or name in ("mlp_pgvc", "mlp_digits") else 32
        m = build_model(name, 7, 3, s)
        assert m(torch.randn(2, 3, s, s)).shape == (2, 7), name


def test_mlp_accepts_rows_and_hidden():
    m = build_model("mlp", 10, in_features=64, hidden=(32,))
    assert count_params(m) == 64 * 32 + 32 + 32 * 10 + 10
    assert m(torch.randn(5, 64)).shape == (5, 10)
    assert m(torch.randn(5, 1, 8, 8)).shape == (5, 10)


def test_layouts_for_layer_aware_rules():
    # output layer is layer_from_output == 0 in FlatSpec (registration in forward order)
    spec = FlatSpec.from_module(build_model("lenet5", 10, 1, 28))
    last_two = sum(e.numel for e in spec if e.layer_from_output in (0, 1))
    assert last_two == 11_014  # fedpgvc.md §6: n_ctrl = 2 on LeNet-5
    spec = FlatSpec.from_module(build_model("lenet_keras", 10, 1, 28))
    assert sum(e.numel for e in spec if e.layer_from_output in (0, 1)) == 162_214
    spec = FlatSpec.from_module(build_model("resnet18_gn", 100, 3, 32))
    assert len(spec) == 62 and spec.d == 11_220_132  # gcfed.md §6: 62 parameter tensors
    assert [e.name for e in spec if e.layer_from_output == 0] == ["fc.weight", "fc.bias"]
    assert sum(e.kind == "norm" for e in spec) == 2 * 20
    spec = FlatSpec.from_module(build_model("digit_cnn", 10, 1, 8))
    assert len(spec) == 8 and spec.entries[-1].name == "fc2.bias"
    spec = FlatSpec.from_module(build_model("digit_mlp", 10, 1, 8))
    assert len(spec) == 6 and spec.entries[-1].name == "fc3.bias"
    m = build_model("resnet18_gn", 10, 3, 32)
    assert not any(isinstance(x, nn.BatchNorm2d) for x in m.modules())
    assert sum(isinstance(x, nn.GroupNorm) and x.num_groups == 32 for x in m.modules()) == 20
    mbn = build_model("resnet18_gn", 10, 3, 32, norm="bn")
    assert count_params(mbn) == count_params(m)
    assert any(isinstance(x, nn.BatchNorm2d) for x in mbn.modules())


def test_inits():
    torch.manual_seed(0)
    m = build_model("digit_cnn", 10, 1, 8)  # gcfed: Kaiming-normal(fan_in), zero biases
    assert all(torch.count_nonzero(p) == 0 for n, p in m.named_parameters() if n.endswith("bias"))
    w = m.fc1.weight.detach()
    assert abs(float(w.std()) - (2.0 / w.shape[1]) ** 0.5) < 0.2 * (2.0 / w.shape[1]) ** 0.5
    t = build_model("digit_cnn", 10, 1, 8, init="torch")
    assert torch.count_nonzero(t.fc1.bias) > 0
    v = build_model("vgg11_cifar", 10, 3, 32)  # N(0, sqrt(2/(9*C_out))), zero conv biases
    conv = v.features[0]
    assert torch.count_nonzero(conv.bias) == 0
    expected = (2.0 / (9 * 64)) ** 0.5
    assert abs(float(conv.weight.detach().std()) - expected) < 0.15 * expected
    toy = build_model("toy_cifar", 10, 3, 32)
    assert abs(float(toy.fc1.weight.detach().std()) - 0.01) < 0.001
    k = build_model("mlp", 10, 1, 28, init="kaiming")
    assert torch.count_nonzero(k.fc1.bias) == 0
    with pytest.raises(ValueError, match="init"):
        build_model("mlp", 10, init="xavier")


def test_dropout_option_and_eval_determinism():
    m = build_model("vgg11_cifar", 10, 3, 32, dropout=0.5)
    assert sum(isinstance(x, nn.Dropout) and x.p == 0.5 for x in m.modules()) == 2
    m.eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(m(x), m(x))


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("alexnet", 10)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", 0)
    with pytest.raises(ValueError, match="too small"):
        build_model("vgg11_cifar", 10, 3, 16)
    with pytest.raises(ValueError, match="too small"):
        build_model("lenet5", 10, 1, 8)
    with pytest.raises(ValueError, match="norm"):
        build_model("resnet18_gn", 10, 3, 32, norm="ln")


def test_aliases():
    with torch.device("meta"):
        assert count_params(build_model("cnn_mnist", 10, 1, 28)) == 1_663_370
        assert count_params(build_model("cnn5_cifar", 100, 3, 32)) == 69_656
        assert count_params(build_model("resnet18", 100, 3, 32)) == 11_220_132
