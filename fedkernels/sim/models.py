"""The models of the five papers (and small CPU stand-ins), built by name.

``build_model(name, num_classes, in_channels, input_size, **kw)``; ``MODELS`` maps names to
builders. Every model takes ``[N, C, H, W]`` images (the MLPs and the logistic regression also take
``[N, F]`` rows and flatten anything else). Modules are registered in forward order, so
``FlatSpec.layer_from_output == 0`` is the classifier.

Parameter counts (checked in tests/test_models.py against the numbers the specs state):

=====================  ===========================================  ============  ============
name                   definition (spec)                            setting       params
=====================  ===========================================  ============  ============
fedavg_cnn             FedAvg CNN: conv5x5 C->32 p2, pool, conv5x5   MNIST, 10     1,663,370
                       32->64 p2, pool, fc ->512, fc 512->C          CIFAR-10      2,156,490
                       (kuramoto FedAvgNetMNIST; gcfed CNN)
vgg11_cifar            VGG-11 (config A), no BN, fc 512-512-C        CIFAR-10      9,750,922
                       (kuramoto code; FedNova models/vgg.py, fedecado)
vgg11                  torchvision vgg11 (no BN): avgpool 7x7,       CIFAR-100     129,176,036
                       fc 25088-4096-4096-C (gcfed)
resnet18_gn            CIFAR ResNet-18, GroupNorm(32) (fedaware,     CIFAR-100     11,220,132
                       gcfed), 62 parameter tensors
resnet34_gn            CIFAR ResNet-34 [3,4,6,3] (fedecado)          CIFAR-100     21,328,292
toy_cifar              FedAWARE ToyCifarNet                          CIFAR-10      122,570
lenet5                 LeNet-5 (ReLU): fedpgvc [REC] for MNIST and   MNIST, 10     44,426
                       the "5-layer CNN" of the CIFAR-100 code       CIFAR-100     69,656
lenet_keras            fedpgvc's code LeNet (tanh, avg-pool,         MNIST, 10     164,116
                       Dense(120) per position)
small_cnn              fedecado E3: conv5x5 1->16, pool, conv5x5     MNIST, 10     18,378
                       16->32, pool, fc 512->10 (spec: "about 21k")
digit_cnn              gcfed DigitCNN (8x8 digits)                   digits        22,154
digit_cnn_pgvc         fedpgvc 8x8 CNN analogue                      digits        7,510
mlp                    784-200-200-10 (fedaware code MLP)            MNIST         199,210
mlp_gcfed              784-512-256-62 (gcfed EMNIST MLP)             EMNIST, 62    549,182
digit_mlp              64-128-64-10 (gcfed DigitMLP)                 digits        17,226
mlp_pgvc               64-64-32-10 (fedpgvc)                         digits        6,570
mlp_digits             64-128-10 (kuramoto KR-2, fedaware FR-2)      digits        9,610
logreg                 multinomial logistic regression (fedecado)    60 feat, 10   610
=====================  ===========================================  ============  ============

``keras_layers`` (the small models): the model as a Keras ``Sequential`` would list its layers
(parameterised modules by name, activations folded in, "pool"/"flatten" for parameter-free layers);
FedPGVC's ``code`` mode indexes the released script's r by this list (algorithms/fedpgvc/modes.py).

Initialisation follows each spec where it names one; ``init=`` overrides it: "model" (the
default: as the class builds it), "torch" (PyTorch's layer defaults), "kaiming" (Kaiming-normal
fan_in weights and zero biases, as in the GC-Fed code). The registry entries for GC-Fed's models
(mlp_gcfed, digit_mlp, digit_cnn) default to "kaiming"; use ``init="kaiming"`` for GC-Fed's CNN.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch
from torch import nn
import torch.nn.functional as F

__all__ = [
    "MODELS",
    "build_model",
    "count_params",
    "register_model",
    "MLP",
    "LogReg",
    "FedAvgCNN",
    "ToyCifarNet",
    "LeNet5",
    "LeNetKeras",
    "SmallCNN",
    "DigitCNN",
    "DigitCNNPGVC",
    "VGG11Cifar",
    "VGG11",
    "ResNetGN",
]


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _conv_out(size: int, k: int, pad: int = 0, stride: int = 1) -> int:
    return (size + 2 * pad - k) // stride + 1


def _check_size(name: str, size: int, need: int):
    if size < need:
        raise ValueError(f"{name}: input_size {size} too small (needs >= {need})")


def init_fanout_conv_small_linear(model: nn.Module) -> nn.Module:
    """torchvision-VGG-style init used by FedAWARE's code: Kaiming-normal (fan_out) convs,
    N(0, 0.01) linears, zero biases."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            nn.init.zeros_(m.bias)
    return model


def init_kaiming_fan_in(model: nn.Module) -> nn.Module:
    """Kaiming-normal(fan_in, ReLU gain) weights and zero biases for conv and linear layers."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


def _apply_init(model: nn.Module, init: Optional[str], default: str) -> nn.Module:
    """init: "model" = as constructed (the spec's init where the class sets one), "torch" =
    PyTorch's default layer init, "kaiming" = Kaiming-normal(fan_in) weights, zero biases."""
    init = default if init is None else init
    if init == "kaiming":
        return init_kaiming_fan_in(model)
    if init == "torch":
        for m in model.modules():
            if m is not model and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        return model
    if init != "model":
        raise ValueError(f"init must be 'model', 'torch' or 'kaiming', got {init!r}")
    return model


# ================================================================================================
# Tabular / flattened models
# ================================================================================================
class MLP(nn.Module):
    """Flatten -> [Linear -> ReLU] * len(hidden) -> Linear. Layers are fc1, fc2, ..."""

    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (200, 200)):
        super().__init__()
        dims = [int(in_features), *[int(h) for h in hidden], int(num_classes)]
        self.num_layers = len(dims) - 1
        for i in range(self.num_layers):
            setattr(self, f"fc{i + 1}", nn.Linear(dims[i], dims[i + 1]))

    @property
    def keras_layers(self):
        return ("flatten",) + tuple(f"fc{i + 1}" for i in range(self.num_layers))

    def forward(self, x):
        x = x.flatten(1)
        for i in range(1, self.num_layers):
            x = F.relu(getattr(self, f"fc{i}")(x))
        return getattr(self, f"fc{self.num_layers}")(x)


class LogReg(nn.Module):
    """Multinomial logistic regression: one Linear on the flattened input (softmax in the loss)."""

    keras_layers = ("flatten", "fc")

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(int(in_features), int(num_classes))

    def forward(self, x):
        return self.fc(x.flatten(1))


# ================================================================================================
# Small CNNs
# ================================================================================================
class FedAvgCNN(nn.Module):
    """The FedAvg CNN (McMahan et al.): two 5x5 convs (32, 64; pad 2) with 2x2 max-pools, fc 512.

    MNIST/FMNIST (Kuramoto ``FedAvgNetMNIST``): 1,663,370 params; CIFAR-10 (GC-Fed CNN): 2,156,490.
    """

    keras_layers = ("conv1", "pool", "conv2", "pool", "flatten", "fc1", "fc2")

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        input_size: int = 28,
        widths: tuple = (32, 64, 512),
        name: str = "fedavg_cnn",
    ):
        super().__init__()
        _check_size(name, input_size, 4)
        c1, c2, hidden = widths
        self.conv1 = nn.Conv2d(in_channels, c1, 5, padding=2)
        self.conv2 = nn.Conv2d(c1, c2, 5, padding=2)
        side = input_size // 2 // 2
        self.fc1 = nn.Linear(c2 * side * side, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class ToyCifarNet(nn.Module):
    """FedAWARE's CIFAR-10 "5-layer CNN" (122,570 params on 32x32x3, 10 classes).

    Its init (as in the code): Kaiming-normal(fan_out) convs, N(0, 0.01) linears, zero biases.
    """

    keras_layers = ("conv1", "pool", "conv2", "pool", "conv3", "flatten", "fc1", "fc2")

    def __init__(self, num_classes: int = 10, in_channels: int = 3, input_size: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.conv3 = nn.Conv2d(64, 64, 3)
        side = _conv_out(_conv_out(_conv_out(input_size, 3) // 2, 3) // 2, 3)
        if side < 1:
            raise ValueError(f"toy_cifar: input_size {input_size} too small")
        self.fc1 = nn.Linear(64 * side * side, 64)
        self.fc2 = nn.Linear(64, num_classes)
        self.reset_spec_init()

    def reset_spec_init(self):
        init_fanout_conv_small_linear(self)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class LeNet5(nn.Module):
    """LeNet-5 with ReLU and max-pool: conv5x5 C->6, pool, conv5x5 6->16, pool, fc 120, 84, C.

    MNIST 28x28 (flatten 256): 44,426 params (FedPGVC [REC]). CIFAR 32x32x3 with 100 classes
    (flatten 400): 69,656 params, the FedPGVC code's "5-layer CNN (Duan et al. 2023)".
    """

    keras_layers = ("conv1", "pool", "conv2", "pool", "flatten", "fc1", "fc2", "fc3")  # create_cnn_model

    def __init__(self, num_classes: int = 10, in_channels: int = 1, input_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        side = _conv_out(_conv_out(input_size, 5) // 2, 5) // 2
        if side < 1:
            raise ValueError(f"lenet5: input_size {input_size} too small")
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


class LeNetKeras(nn.Module):
    """FedPGVC's code LeNet (Keras): conv5x5 C->6 tanh, avgpool, conv5x5 6->6 tanh, avgpool,
    Dense(120, tanh) per spatial position (a 1x1 conv), flatten, Dense(84, tanh), Dense(C).

    164,116 params on 28x28 (the last two layers hold 162,214).
    """

    keras_layers = ("conv1", "pool", "conv2", "pool", "dense1", "flatten", "fc1", "fc2")  # build_lenet

    def __init__(self, num_classes: int = 10, in_channels: int = 1, input_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 6, 5)
        side = _conv_out(_conv_out(input_size, 5) // 2, 5) // 2
        if side < 1:
            raise ValueError(f"lenet_keras: input_size {input_size} too small")
        self.dense1 = nn.Conv2d(6, 120, 1)
        self.fc1 = nn.Linear(120 * side * side, 84)
        self.fc2 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.avg_pool2d(torch.tanh(self.conv1(x)), 2)
        x = F.avg_pool2d(torch.tanh(self.conv2(x)), 2)
        x = torch.tanh(self.dense1(x))
        x = x.permute(0, 2, 3, 1).flatten(1)  # Keras channels-last flatten order
        return self.fc2(torch.tanh(self.fc1(x)))


class SmallCNN(nn.Module):
    """FedECADO E3: conv5x5 C->16, ReLU, pool, conv5x5 16->32, ReLU, pool, fc ->C (no padding).

    18,378 params on 28x28 (flatten 512). The spec says "about 21k"; its own layer list gives
    416 + 12,832 + 5,130 = 18,378, which is what we build.
    """

    keras_layers = ("conv1", "pool", "conv2", "pool", "flatten", "fc")

    def __init__(self, num_classes: int = 10, in_channels: int = 1, input_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        side = _conv_out(_conv_out(input_size, 5) // 2, 5) // 2
        if side < 1:
            raise ValueError(f"small_cnn: input_size {input_size} too small")
        self.fc = nn.Linear(32 * side * side, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class DigitCNN(FedAvgCNN):
    """GC-Fed's DigitCNN for 8x8 digits: conv5x5 1->16 p2, pool, conv5x5 16->32 p2, pool,
    fc 128->64, fc 64->C. 8 parameter tensors, classifier ``fc2``; 22,154 params.
    (The FedAvg CNN's layout with narrower layers.)"""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, input_size: int = 8):
        super().__init__(num_classes, in_channels, input_size, widths=(16, 32, 64), name="digit_cnn")


class DigitCNNPGVC(nn.Module):
    """FedPGVC's "5-layer CNN analogue" for 8x8: conv3x3 1->6 p1, pool, conv3x3 6->16 p1, pool,
    fc 64->64->32->C (ReLU). 7,510 params."""

    keras_layers = ("conv1", "pool", "conv2", "pool", "flatten", "fc1", "fc2", "fc3")

    def __init__(self, num_classes: int = 10, in_channels: int = 1, input_size: int = 8):
        super().__init__()
        _check_size("digit_cnn_pgvc", input_size, 4)
        self.conv1 = nn.Conv2d(in_channels, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 16, 3, padding=1)
        side = input_size // 2 // 2
        self.fc1 = nn.Linear(16 * side * side, 64)
        self.fc2 = nn.Linear(64, 32)
        self.fc3 = nn.Linear(32, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


# ================================================================================================
# VGG
# ================================================================================================
_VGG11_CFG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def _vgg_features(in_channels: int) -> nn.Sequential:
    layers, c = [], in_channels
    for v in _VGG11_CFG:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
            c = v
    return nn.Sequential(*layers)


class VGG11Cifar(nn.Module):
    """CIFAR VGG-11 (config A, no BatchNorm) with a 512-512-C classifier: 9,750,922 params for
    CIFAR-10. Kuramoto code: no dropout; FedNova's ``models/vgg.py`` (FedECADO): ``dropout=0.5``.
    Its init (as in both codes): convs N(0, sqrt(2 / (k*k*C_out))), conv biases 0; linears PyTorch
    default.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, input_size: int = 32, dropout: float = 0.0):
        super().__init__()
        _check_size("vgg11_cifar", input_size, 32)
        self.features = _vgg_features(in_channels)
        side = input_size // 32
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(512 * side * side, 512),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(512, 512),
            nn.ReLU(inplace=True),
            nn.Linear(512, num_classes),
        )
        self.reset_spec_init()

    def reset_spec_init(self):
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                nn.init.normal_(m.weight, 0.0, (2.0 / n) ** 0.5)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class VGG11(nn.Module):
    """torchvision ``vgg11`` (no BN) as GC-Fed uses it: AdaptiveAvgPool(7, 7) then
    25088-4096-4096-C with dropout 0.5. 129,176,036 params for CIFAR-100. torchvision's init:
    Kaiming-normal(fan_out) convs, N(0, 0.01) linears, zero biases."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3, input_size: int = 32, dropout: float = 0.5):
        super().__init__()
        _check_size("vgg11", input_size, 32)
        self.features = _vgg_features(in_channels)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )
        self.reset_spec_init()

    def reset_spec_init(self):
        init_fanout_conv_small_linear(self)

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


# ================================================================================================
# ResNet (CIFAR stem, GroupNorm)
# ================================================================================================
def _norm(kind: str, c: int, groups: int) -> nn.Module:
    if kind == "gn":
        return nn.GroupNorm(min(groups, c), c)
    if kind == "bn":
        return nn.BatchNorm2d(c)
    raise ValueError(f"norm must be 'gn' or 'bn', got {kind!r}")


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, cout: int, stride: int, norm: str, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, cout, groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = _norm(norm, cout, groups)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _norm(norm, cout, groups)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        idt = x if self.downsample is None else self.downsample(x)
        return F.relu(out + idt)


class ResNetGN(nn.Module):
    """CIFAR ResNet (BasicBlock): conv3x3 stem (stride 1, no bias) + norm + ReLU, no max-pool,
    stages of widths 64/128/256/512 with strides 1/2/2/2, global average pool, fc 512->C.

    Every norm is GroupNorm(32, C) by default (``norm="bn"`` for BatchNorm). Layer names follow
    torchvision (conv1, bn1, layer1..4, fc). ResNet-18 [2,2,2,2]: 11,220,132 params for 100 classes
    (62 tensors); ResNet-34 [3,4,6,3]: 21,328,292. Global average pooling equals FedAWARE's
    avg_pool2d(4) on 32x32 input and also works on 64x64 (TinyImageNet). ``width``: the first stage's
    width (64, the papers'; the stages are width x 1/2/4/8), smaller for CPU stand-ins and tests.
    """

    def __init__(
        self,
        blocks: Sequence[int] = (2, 2, 2, 2),
        num_classes: int = 100,
        in_channels: int = 3,
        input_size: int = 32,
        norm: str = "gn",
        groups: int = 32,
        width: int = 64,
    ):
        super().__init__()
        _check_size("resnet", input_size, 8)
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an integer >= 1, got {width!r}")
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = _norm(norm, width, groups)
        cin = width
        for i, (w, n) in enumerate(zip((width, 2 * width, 4 * width, 8 * width), blocks)):
            stride = 1 if i == 0 else 2
            layer = []
            for b in range(n):
                layer.append(BasicBlock(cin, w, stride if b == 0 else 1, norm, groups))
                cin = w
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.fc = nn.Linear(8 * width, num_classes)
        self.reset_spec_init()

    def reset_spec_init(self):
        # torchvision's ResNet init
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


# ================================================================================================
# Registry
# ================================================================================================
ModelBuilder = Callable[..., nn.Module]
MODELS: Dict[str, ModelBuilder] = {}


def register_model(name: str):
    def deco(fn: ModelBuilder) -> ModelBuilder:
        if name in MODELS:
            raise ValueError(f"model {name!r} already registered")
        MODELS[name] = fn
        return fn

    return deco


def _features(in_channels: int, input_size: int, flat_features: Optional[int]) -> int:
    if flat_features is not None:
        return int(flat_features)
    return int(in_channels) * int(input_size) * int(input_size)


def _mlp_builder(default_hidden, default_init):
    def build(num_classes, in_channels=1, input_size=28, *, hidden=None, in_features=None, init=None):
        m = MLP(
            _features(in_channels, input_size, in_features), num_classes, default_hidden if hidden is None else hidden
        )
        return _apply_init(m, init, default_init)

    return build


register_model("mlp")(_mlp_builder((200, 200), "model"))  # fedaware MLP(784, 200, 200, 10)
register_model("mlp_gcfed")(_mlp_builder((512, 256), "kaiming"))  # gcfed EMNIST MLP
register_model("digit_mlp")(_mlp_builder((128, 64), "kaiming"))  # gcfed DigitMLP
register_model("mlp_pgvc")(_mlp_builder((64, 32), "model"))  # fedpgvc digits MLP
register_model("mlp_digits")(_mlp_builder((128,), "model"))  # kuramoto KR-2 / fedaware FR-2


@register_model("logreg")
def _logreg(num_classes, in_channels=1, input_size=28, *, in_features=None, init=None):
    return _apply_init(LogReg(_features(in_channels, input_size, in_features), num_classes), init, "model")


def _simple(cls, default_init, **fixed):
    def build(num_classes, in_channels=1, input_size=28, *, init=None, **kw):
        return _apply_init(
            cls(num_classes=num_classes, in_channels=in_channels, input_size=input_size, **fixed, **kw),
            init,
            default_init,
        )

    return build


# Kuramoto's FedAvgNetMNIST has PyTorch's default init; GC-Fed's CNN is Kaiming(fan_in) (init=).
register_model("fedavg_cnn")(_simple(FedAvgCNN, "model"))
register_model("toy_cifar")(_simple(ToyCifarNet, "model"))
register_model("lenet5")(_simple(LeNet5, "model"))
register_model("lenet_keras")(_simple(LeNetKeras, "model"))
register_model("small_cnn")(_simple(SmallCNN, "model"))
register_model("digit_cnn")(_simple(DigitCNN, "kaiming"))
register_model("digit_cnn_pgvc")(_simple(DigitCNNPGVC, "model"))
register_model("vgg11_cifar")(_simple(VGG11Cifar, "model"))
register_model("vgg11")(_simple(VGG11, "model"))
register_model("resnet18_gn")(_simple(ResNetGN, "model", blocks=(2, 2, 2, 2)))
register_model("resnet34_gn")(_simple(ResNetGN, "model", blocks=(3, 4, 6, 3)))

_MODEL_ALIASES = {
    "cnn_mnist": "fedavg_cnn",
    "cnn_cifar": "fedavg_cnn",
    "fedavgnetmnist": "fedavg_cnn",
    "cnn5_cifar": "lenet5",
    "lenet": "lenet5",
    "resnet18": "resnet18_gn",
    "resnet34": "resnet34_gn",
    "vgg11_tv": "vgg11",
    "mlp_emnist": "mlp_gcfed",
    "logistic": "logreg",
}


def build_model(name: str, num_classes: int, in_channels: int = 1, input_size: int = 28, **kw) -> nn.Module:
    """Builds the registered model ``name`` for ``num_classes`` outputs and inputs of shape
    [in_channels, input_size, input_size] (MLP / logreg: ``in_features=F`` for [N, F] rows).

    Extra keywords go to the builder: ``init`` ("torch" | "kaiming" | "model"), ``hidden`` (MLPs),
    ``dropout`` (VGGs), ``norm`` / ``groups`` / ``width`` (ResNets).
    Aliases: cnn_mnist / cnn_cifar -> fedavg_cnn, cnn5_cifar -> lenet5, resnet18 -> resnet18_gn,
    vgg11_tv -> vgg11, mlp_emnist -> mlp_gcfed, logistic -> logreg.
    """
    key = _MODEL_ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    if int(num_classes) < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return MODELS[key](int(num_classes), int(in_channels), int(input_size), **kw)
