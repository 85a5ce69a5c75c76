"""Run configuration: nested dataclasses, YAML load/save and dotted ``key=value`` overrides.

A run is described by one :class:`RunConfig`::

    cfg = RunConfig.from_yaml("exp.yaml")            # or presets.get("smoke")
    cfg = apply_overrides(cfg, ["train.lr=0.05", "algorithm.name=kuramoto",
                                "algorithm.options.kappa0=0.5", "rounds=20"])
    cfg.to_yaml("resolved.yaml")

Override values are parsed with ``yaml.safe_load`` (so ``0.1`` is a float, ``[1, 5]`` a list, ``null``
None, ``true`` a bool). Keys under the free-form ``options`` dicts may be new; any other unknown key
is an error naming the valid keys.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import re
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import yaml


@dataclass
class DataConfig:
    name: str = "digits"  # fmnist | mnist5k | digits | mnist | cifar10 | cifar100
    root: Optional[str] = None  # user directory for datasets that are not bundled
    train_subset: Optional[int] = None  # keep this many training examples (seeded, stratified-free)
    test_subset: Optional[int] = None
    augment: Any = False  # True: the dataset's suggested train augmentation; or a recipe ("crop_flip")
    options: Dict[str, Any] = field(default_factory=dict)  # extra load_dataset keyword arguments


@dataclass
class PartitionConfig:
    scheme: str = "iid"  # iid | shards | dirichlet
    seed: Optional[int] = None  # None: the run seed (the partition is shared by all methods)
    options: Dict[str, Any] = field(default_factory=dict)  # e.g. shards_per_client, alpha, convention, min_size


@dataclass
class ModelConfig:
    name: str = "mlp"
    options: Dict[str, Any] = field(default_factory=dict)  # extra build_model keyword arguments


@dataclass
class HeteroConfig:
    """Per-client heterogeneous compute (FedECADO §6): lr_i ~ U[lr_range], E_i ~ U{epochs_range}."""

    enabled: bool = False
    lr_range: Optional[List[float]] = None  # [low, high]; None: every client uses train.lr
    lr_dist: str = "uniform"  # uniform | loguniform
    epochs_range: Optional[List[int]] = None  # [low, high] inclusive; None: train.epochs
    redraw: str = "run"  # run: drawn once per client; round: redrawn every round


@dataclass
class TrainConfig:
    epochs: int = 1  # local epochs (ignored when steps is set)
    steps: Optional[int] = None  # local steps (mini-batches) instead of epochs
    batch_size: int = 32
    optimizer: str = "sgd"  # sgd | adam
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    lr_schedule: str = "constant"  # constant | cosine | step  (over rounds)
    lr_min: float = 0.0  # cosine floor
    lr_step: int = 1  # step schedule: multiply by lr_gamma every lr_step rounds
    lr_gamma: float = 0.99
    drop_last: bool = False
    grad_clip: Optional[float] = None  # max global grad norm (None: no clipping)
    hetero: HeteroConfig = field(default_factory=HeteroConfig)


@dataclass
class AlgorithmConfig:
    name: str = "fedavg"
    options: Dict[str, Any] = field(default_factory=dict)  # algorithms.build(name, **options)


@dataclass
class CompressConfig:
    """Compressed client updates (fedkernels.compress; sim/compression.py). kind: none | int8_block | fp8 | topk | qsgd."""

    kind: str = "none"
    block: Optional[int] = None  # int8_block / fp8 / qsgd: columns per scale (1..d; default min(256, d))
    k: Optional[int] = None  # topk: entries kept (1..d), or
    ratio: Optional[float] = None  # topk: their fraction of d, in (0, 1]
    error_feedback: bool = False  # per-client residuals added to the next update (Stich 2018, Karimireddy 2019)
    levels: int = 16  # qsgd: s, in [1, 127]
    seed: Optional[int] = None  # qsgd's stochastic rounding stream (default: the run's seed)
    residual_file: Optional[str] = None  # error feedback's residuals in this file (N x d float32 table), not in memory


def dir_label(label: str) -> str:
    """A method label as one path component of a run directory: path separators become ``_``
    (``fedavg:server_lr_schedule=dir/x.json`` would otherwise nest directories)."""
    return label.replace("/", "_").replace("\\", "_")


@dataclass
class RunConfig:
    name: Optional[str] = None  # run directory name under out_dir (default: derived, see run_name)
    preset: Optional[str] = None  # the preset this config came from (a label; set by presets.get)
    method: Optional[str] = None  # the preset's method label that was run (a label)
    seed: int = 0
    rounds: int = 10
    num_clients: int = 10
    participation: float = 1.0  # fraction of clients per round (used when clients_per_round is None)
    clients_per_round: Optional[int] = None
    eval_every: int = 1  # evaluate every N rounds (and always after the last)
    eval_batch_size: int = 1024
    client_loss: str = "participants"  # global model's loss on clients' train data: participants | all | none
    target_accuracy: Optional[float] = None  # for rounds-to-target in the summary (fraction, e.g. 0.85)
    bad_client_policy: str = "exclude"  # exclude | raise
    device: str = "cpu"  # cpu | cuda | auto
    threads: Optional[int] = None  # torch.set_num_threads for the run, per process (None: torch's default;
    # the CLI chooses for the load); in the config hash: it changes the bits
    workers: int = 1  # train a round's clients in N worker processes (sim.workers; CPU)
    clients_at_once: Union[str, int, bool] = "auto"  # batched local training (sim.batched): auto (CUDA: on,
    # CPU: off) | off | N clients per vmapped chunk; equal to off up to
    # fp32 rounding, so not in the config hash (like workers)
    deterministic: Optional[bool] = None  # torch.use_deterministic_algorithms; None: on CUDA only (CPU kernels
    # are deterministic at a fixed thread count, and the flag slows them)
    out_dir: str = "runs"
    checkpoint_every: int = 0  # 0: no checkpoints
    keep_checkpoints: int = 2
    plots: bool = True
    progress: Optional[bool] = None  # None: only when stderr is a tty
    verbose: bool = True  # one printed line per evaluated round
    distributed: bool = False  # ranks of torch.distributed split each round's clients (sim.distributed_sim)
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    dp: "DPConfig" = field(default_factory=lambda: DPConfig())  # differential privacy (off: dp.kind null)
    attack: "AttackConfig" = field(default_factory=lambda: AttackConfig())  # Byzantine attackers (sim/attacks.py)
    compress: CompressConfig = field(default_factory=CompressConfig)
    lora: "LoraConfig" = field(default_factory=lambda: LoraConfig())  # LoRA fine-tuning (sim/lora.py; off: mode null)

    # ---- derived ---------------------------------------------------------------------------------
    def per_round(self) -> int:
        """Clients sampled per round."""
        if self.clients_per_round is not None:
            m = int(self.clients_per_round)
        else:
            m = int(round(self.participation * self.num_clients))
        return max(1, min(self.num_clients, m))

    def run_name(self) -> str:
        """``name``, or ``<preset or dataset>-<method label or algorithm>-s<seed>-<config hash>``: a
        different computation never lands in the same directory."""
        if self.name:
            return self.name
        return f"{self.preset or self.data.name}-{dir_label(self.method or self.algorithm.name)}-s{self.seed}-{self.config_hash()}"

    def config_hash(self, n: int = 8) -> str:
        """A short hash of everything that changes the computation (not output/progress settings)."""
        d = {k: v for k, v in self.to_dict().items() if k not in PRESENTATION_KEYS}
        if d.get("dp", {}).get("kind") is None:
            d.pop("dp", None)  # DP off: the hash (and the run directory) of a config without the section
        if self.attack.kind is None:  # no attack: the hash of a config without the section
            d.pop("attack", None)
        if d.get("compress", {}).get("kind", "none") == "none":  # uncompressed runs keep their hashes
            d.pop("compress", None)
        if d.get("compress", {}).get("residual_file") is None:  # where residuals live does not change the numbers
            d.get("compress", {}).pop("residual_file", None)
        if d.get("lora", {}).get("mode") is None:  # no LoRA: the hash of a config without the section
            d.pop("lora", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:n]

    def validate(self) -> "RunConfig":
        errs = range_errors(self)
        if errs:  # the first out-of-range number, alone (the checks below may assume sane numbers)
            raise ValueError("invalid config: " + errs[0])
        if self.clients_per_round is not None and not 1 <= self.clients_per_round <= self.num_clients:
            errs.append(
                f"clients_per_round must be in [1, num_clients={self.num_clients}], got {self.clients_per_round}"
            )
        if self.workers > 1 and self.distributed:
            errs.append(
                f"workers={self.workers} and distributed=true exclude each other (torchrun ranks already "
                "split the clients): use one of them"
            )
        c = self.clients_at_once
        if not (c in ("auto", "off") or c is False or (isinstance(c, int) and not isinstance(c, bool) and c >= 1)):
            errs.append(f"clients_at_once must be auto, off or an integer >= 1, got {c!r}")
        elif isinstance(c, int) and not isinstance(c, bool) and (self.workers > 1 or self.distributed):
            other = "distributed=true" if self.distributed else f"workers={self.workers}"
            errs.append(f"clients_at_once={c} and {other} exclude each other: use one of them")
        if self.client_loss not in ("participants", "all", "none"):
            errs.append(f"client_loss must be participants|all|none, got {self.client_loss!r}")
        from .compression import config_errors as _compress_errors  # the compress section's checks

        errs += _compress_errors(self.compress, self.checkpoint_every, self.distributed)
        if self.bad_client_policy not in ("exclude", "raise"):
            errs.append(f"bad_client_policy must be exclude|raise, got {self.bad_client_policy!r}")
        t = self.train
        if t.lr_schedule not in ("constant", "cosine", "step"):
            errs.append(f"train.lr_schedule must be constant|cosine|step, got {t.lr_schedule!r}")
        if t.optimizer not in ("sgd", "adam"):
            errs.append(f"train.optimizer must be sgd|adam, got {t.optimizer!r}")
        h = t.hetero
        if h.redraw not in ("run", "round"):
            errs.append(f"train.hetero.redraw must be run|round, got {h.redraw!r}")
        if h.lr_dist not in ("uniform", "loguniform"):
            errs.append(f"train.hetero.lr_dist must be uniform|loguniform, got {h.lr_dist!r}")
        for nm, rg in (("lr_range", h.lr_range), ("epochs_range", h.epochs_range)):
            if rg is not None and (len(rg) != 2 or rg[0] > rg[1] or rg[0] <= 0):
                errs.append(f"train.hetero.{nm} must be [low, high] with 0 < low <= high, got {rg}")
        errs += dp_errors(self)
        errs += attack_config_errors(self)
        errs += lora_config_errors(self)
        if errs:
            raise ValueError("invalid config: " + "; ".join(errs))
        return self

    # ---- (de)serialisation -------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RunConfig":
        return _from_dict(cls, d or {}, "")

    def to_yaml(self, path: Optional[str] = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_yaml(cls, path_or_text: str) -> "RunConfig":
        """A config from a YAML file or text; ValueError (one line, naming the file and line) for an
        unreadable file or a YAML syntax error. Numbers in YAML 1.2 forms (``1e-3``) are numbers."""
        where = "config text"
        if "\n" not in path_or_text and not path_or_text.lstrip().startswith("{"):
            where = path_or_text
            try:
                with open(path_or_text) as f:
                    text = f.read()
            except FileNotFoundError:
                raise ValueError(f"config file not found: {path_or_text}") from None
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"config file {path_or_text}: cannot be read ({e.strerror or e})") from None
        else:
            text = path_or_text
        try:
            d = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = " ".join(str(getattr(e, "problem", None) or e).split())
            raise ValueError(f"{where}: YAML syntax error{at}: {what}") from None
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"{where}: config YAML must be a mapping at the top level, got {type(d).__name__}")
        return cls.from_dict(d or {})

    def copy(self) -> "RunConfig":
        return copy.deepcopy(self)


# The range of every numeric config key (checked by validate() when the value is not null; one line
# naming the key, the value and the range). Ranges: "> a", ">= a", "[a, b)", "(a, b]", "[a, b]", "(a, b)".
RANGES: Dict[str, str] = {
    "seed": ">= 0",
    "rounds": ">= 1",
    "num_clients": ">= 1",
    "participation": "(0, 1]",
    "clients_per_round": ">= 1",
    "eval_every": ">= 1",
    "eval_batch_size": ">= 1",
    "target_accuracy": "(0, 1]",
    "threads": ">= 1",
    "workers": ">= 1",
    "checkpoint_every": ">= 0",
    "keep_checkpoints": ">= 0",
    "data.train_subset": ">= 1",
    "data.test_subset": ">= 1",
    "partition.seed": ">= 0",
    "train.epochs": ">= 1",
    "train.steps": ">= 1",
    "train.batch_size": ">= 1",
    "train.lr": "> 0",
    "train.momentum": "[0, 1)",
    "train.weight_decay": ">= 0",
    "train.lr_min": ">= 0",
    "train.lr_step": ">= 1",
    "train.lr_gamma": "(0, 1]",
    "train.grad_clip": "> 0",
}
RANGES.update(
    {
        "compress.block": ">= 1",
        "compress.k": ">= 1",
        "compress.ratio": "(0, 1]",
        "compress.levels": "[1, 127]",
        "compress.seed": ">= 0",
    }
)  # block <= d and k <= d are checked when the model is built


def in_range(value: Any, spec: str) -> bool:
    """Whether the finite number ``value`` lies in range ``spec`` (see RANGES); NaN and inf never do."""
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")):
        return False
    if spec.startswith(">="):
        return v >= float(spec[2:])
    if spec.startswith(">"):
        return v > float(spec[1:])
    lo, hi = (float(x) for x in spec[1:-1].split(","))
    return (v >= lo if spec[0] == "[" else v > lo) and (v <= hi if spec[-1] == "]" else v < hi)


def range_words(spec: str) -> str:
    """``"> 0"`` -> ``"> 0"``, ``"[0, 1)"`` -> ``"in [0, 1)"`` (for "must be ...")."""
    return spec if spec[0] in "<>" else "in " + spec


def range_errors(cfg: "RunConfig") -> List[str]:
    """``"KEY must be RANGE, got VALUE"`` for every numeric key of ``cfg`` outside its RANGES entry."""
    out = []
    for key, spec in RANGES.items():
        v: Any = cfg
        for part in key.split("."):
            v = getattr(v, part)
        if v is not None and not isinstance(v, bool) and isinstance(v, (int, float)) and not in_range(v, spec):
            out.append(f"{key} must be {range_words(spec)}, got {v}")
    return out


# keys that do not change what is computed (left out of config_hash; free to change on resume).
# ``threads`` is not one: CPU kernels round differently at another thread count (workers=N gives the
# bits of workers=1 at the same threads per process)
PRESENTATION_KEYS = (
    "name",
    "preset",
    "method",
    "eval_batch_size",
    "out_dir",
    "checkpoint_every",
    "keep_checkpoints",
    "plots",
    "progress",
    "verbose",
    "target_accuracy",
    "distributed",
    "workers",
    "clients_at_once",
)


def _suggest(word: Any, choices: Iterable[Any], fmt: str = " (did you mean {!r}?)") -> str:
    """The close-match hint of every "unknown name" error of the simulator (config keys, options,
    algorithms, data sets, models, methods): ``fmt`` filled with the closest of ``choices`` to
    ``word`` (compared as strings, difflib's default cutoff), or "" when none is close."""
    m = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return fmt.format(m[0]) if m else ""


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _type_ok(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin in (list, List):
        (arg,) = typing.get_args(tp) or (Any,)
        return isinstance(value, (list, tuple)) and all(_type_ok(v, arg) for v in value)
    if origin in (dict, Dict):
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return True


def _type_word(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        words = [_type_word(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(words) + (" or null" if type(None) in typing.get_args(tp) else "")
    if origin in (list, List):
        (arg,) = typing.get_args(tp) or (Any,)
        return f"a list of {_type_word(arg).replace('an ', '').replace('a ', '')}s"
    if origin in (dict, Dict):
        return "a mapping"
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def check_field(cls, key: str, name: str, value: Any) -> Any:
    """``value`` for field ``name`` of config dataclass ``cls`` (dotted ``key`` for messages), type-checked
    against the field's annotation; an int given for a float field becomes a float. A number field
    takes every form Python's ``float()`` and YAML 1.2 accept, as text too (``"1e-3"``, ``"1_000"``); an
    integer field a whole number in any of them (``1e3``)."""
    tp = typing.get_type_hints(cls)[name]
    if not _type_ok(value, tp):
        args = typing.get_args(tp) if typing.get_origin(tp) is typing.Union else (tp,)
        num = value
        if isinstance(value, str) and (float in args or int in args):
            t = value.strip()
            try:  # float() forms, and YAML 1.2's .inf / .nan (the range checks refuse those)
                num = float({".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}.get(t.lower(), t))
            except ValueError:
                num = value
        if float in args and isinstance(num, float):
            return num
        if int in args and isinstance(num, float) and num == num and abs(num) != float("inf") and num == int(num):
            return int(num)
        raise ValueError(f"config key {key}: got {value!r} ({type(value).__name__}), expected {_type_word(tp)}")
    if tp is float or (typing.get_origin(tp) is typing.Union and float in typing.get_args(tp)):
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
    return value


def _from_dict(cls, d: Dict[str, Any], prefix: str):
    if not isinstance(d, dict):
        raise ValueError(f"config section {prefix or '<root>'!r} must be a mapping, got {type(d).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(prefix + k for k in unknown)}"
            f"{_suggest(unknown[0], list(known))}; "
            f"valid keys{' under ' + prefix[:-1] if prefix else ''}: {', '.join(known)}"
        )
    kw = {}
    for k, v in d.items():
        sub = _dataclass_type(cls, k)
        kw[k] = (
            _from_dict(sub, v if v is not None else {}, prefix + k + ".")
            if sub is not None
            else check_field(cls, prefix + k, k, v)
        )
    return cls(**kw)


_SECTIONS = {
    (RunConfig, "data"): DataConfig,
    (RunConfig, "partition"): PartitionConfig,
    (RunConfig, "model"): ModelConfig,
    (RunConfig, "train"): TrainConfig,
    (RunConfig, "algorithm"): AlgorithmConfig,
    (TrainConfig, "hetero"): HeteroConfig,
    (RunConfig, "compress"): CompressConfig,
}


def _dataclass_type(cls, name: str):
    return _SECTIONS.get((cls, name))


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading YAML 1.2 floats too: ``1e-3``, ``1.0e6``, ``5E+2`` (YAML 1.1, which
    PyYAML follows, wants a dot and a signed exponent and reads them as text)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_value(text: str) -> Any:
    """A command-line value, parsed as YAML (``0.1`` -> float, ``[1,2]`` -> list, ``null`` -> None;
    ``1e-3`` a float as in YAML 1.2)."""
    try:
        return yaml.load(text, Loader=_Loader) if text != "" else ""
    except yaml.YAMLError:
        return text


def set_dotted(cfg: RunConfig, key: str, value: Any) -> None:
    """Sets ``cfg.<key>`` for a dotted key such as ``train.hetero.enabled``; free-form under ``options``."""
    parts = key.split(".")
    obj: Any = cfg
    path = []
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        path.append(p)
        if dataclasses.is_dataclass(obj):
            names = [f.name for f in fields(obj)]
            if p not in names:
                raise ValueError(
                    f"unknown config key {'.'.join(path)!r}{_suggest(p, names)}; valid keys"
                    f"{' under ' + '.'.join(path[:-1]) if len(path) > 1 else ''}: {', '.join(names)}"
                )
            if last:
                sub = _dataclass_type(type(obj), p)
                if sub is not None:
                    if not isinstance(value, dict):
                        raise ValueError(f"config key {key!r} is a section: give a mapping or set its fields")
                    value = _from_dict(sub, value, key + ".")
                else:
                    value = check_field(type(obj), key, p, value)
                setattr(obj, p, value)
                return
            obj = getattr(obj, p)
        elif isinstance(obj, dict):
            if last:
                obj[p] = value
                return
            obj = obj.setdefault(p, {})
            if not isinstance(obj, dict):
                raise ValueError(f"config key {'.'.join(path)!r} is not a mapping")
        else:
            raise ValueError(f"config key {'.'.join(path[:-1])!r} is a value, not a section")


def apply_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """A copy of ``cfg`` with ``key=value`` overrides applied in order."""
    cfg = cfg.copy()
    for ov in overrides:
        if "=" not in ov:
            raise ValueError(f"override {ov!r} must look like key=value (e.g. train.lr=0.05)")
        k, v = ov.split("=", 1)
        set_dotted(cfg, k.strip(), parse_value(v.strip()))
    return cfg


# ---- differential privacy (fedkernels.algorithms.dp; docs/privacy.md) ---------------------------------
@dataclass
class DPConfig:
    """Client-level differential privacy of the released models (the DP wrapper around the method):
    ``kind`` null (off) | central (the server clips each update to ``clip``) | client (clients clip their
    row as they write it) | adaptive (Andrew et al.: ``clip`` is the initial norm); Gaussian noise of std
    ``noise_multiplier * clip / m`` on the average, or ``target_epsilon`` at ``delta`` over the planned
    rounds (the multiplier calibrated before round 1); epsilon from dp-accounting's RDP accountant for the
    simulator's sampling (m of num_clients, uniformly without replacement)."""

    kind: Optional[str] = None  # null | central | client | adaptive
    clip: Optional[float] = None  # the clip norm C (adaptive: the initial C)
    noise_multiplier: Optional[float] = None  # z (exactly one of noise_multiplier and target_epsilon)
    delta: float = 1e-5
    target_epsilon: Optional[float] = None
    target_clipped_quantile: float = 0.5  # adaptive: the quantile of update norms C tracks
    clip_norm_lr: float = 0.2  # adaptive: the geometric step of C
    clipped_count_stddev: Optional[float] = None  # adaptive: the count noise's std (null: m / 20)

    def options(self, cfg: "RunConfig") -> Dict[str, Any]:
        """The DP wrapper's options for run ``cfg`` (``algorithms.build(name, dp=...)``)."""
        return {
            "kind": self.kind,
            "clip": self.clip,
            "noise_multiplier": self.noise_multiplier,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "rounds": cfg.rounds,
            "seed": cfg.seed,
            "num_sampled_clients": cfg.per_round(),
            "population": cfg.num_clients,
            "target_clipped_quantile": self.target_clipped_quantile,
            "clip_norm_lr": self.clip_norm_lr,
            "clipped_count_stddev": self.clipped_count_stddev,
        }


_SECTIONS[(RunConfig, "dp")] = DPConfig
RANGES.update(
    {
        "dp.clip": "> 0",
        "dp.noise_multiplier": ">= 0",
        "dp.delta": "(0, 1)",
        "dp.target_epsilon": "> 0",
        "dp.target_clipped_quantile": "[0, 1]",
        "dp.clip_norm_lr": "> 0",
        "dp.clipped_count_stddev": ">= 0",
    }
)


def dp_errors(cfg: "RunConfig") -> List[str]:
    """The dp section's own checks (numbers: RANGES): a kind, the clip norm, one of noise_multiplier and
    target_epsilon. The method's verdict and the target's reachability: ``checks.check_run``."""
    d = cfg.dp
    if d.kind is None:
        set_keys = [k for k in ("clip", "noise_multiplier", "target_epsilon") if getattr(d, k) is not None]
        return [f"dp.{set_keys[0]} is set but dp.kind is null: set dp.kind=central|client|adaptive"] if set_keys else []
    if d.kind not in ("central", "client", "adaptive"):
        return [f"dp.kind must be central|client|adaptive (or null: off), got {d.kind!r}"]
    if d.clip is None:
        return ["dp.clip is required with dp.kind (the L2 norm each update is clipped to)"]
    if (d.noise_multiplier is None) == (d.target_epsilon is None):
        return ["dp: give exactly one of dp.noise_multiplier and dp.target_epsilon"]
    return []


@dataclass
class AttackConfig:
    """Byzantine attackers (``fedkernels.sim.attacks``): which clients attack and how."""

    kind: Optional[str] = None  # sign_flip | scale | gaussian | alie | ipm | label_flip (null: no attack)
    fraction: Optional[float] = None  # round(fraction * num_clients) attackers drawn from the seed, or
    clients: Optional[List[int]] = None  # the attackers' client ids
    factor: Optional[float] = None  # scale: the multiplier, > 0 (null: the round's K; sign_flip negates)
    std: Optional[float] = None  # gaussian: the noise's standard deviation (null: 1.0)
    z: Optional[float] = None  # alie: z (null: Baruch et al.'s z_max from n and f)
    epsilon: Optional[float] = None  # ipm: epsilon (null: 0.1)


_SECTIONS[(RunConfig, "attack")] = AttackConfig
RANGES.update(
    {
        "attack.fraction": "(0, 1)",
        "attack.factor": "> 0",
        "attack.std": "> 0",
        "attack.z": "> 0",
        "attack.epsilon": "> 0",
    }
)


def attack_config_errors(cfg: RunConfig) -> List[str]:
    """The ``attack.*`` checks (one line each; fedkernels.sim.attacks)."""
    from .attacks import attack_errors

    return attack_errors(cfg)


# ---- LoRA fine-tuning (fedkernels.lora over peft; sim/lora.py; docs/lora.md) ----------------------------
@dataclass
class LoraConfig:
    """Federated LoRA fine-tuning: the model is wrapped with peft, only its adapters are trained, sent and
    aggregated (``mode``: naive = A and B averaged separately, exact = FlexLoRA's re-factorised average of the
    products B_k A_k, fold = FedEx-LoRA's residual folded into the frozen base)."""

    mode: Optional[str] = None  # null (off) | naive | exact | fold
    r: int = 8  # the server's rank (every client's, without ranks)
    alpha: float = 8.0  # lora_alpha: scaling alpha / r (rslora: alpha / sqrt(r)), peft's
    target_modules: Optional[List[str]] = None  # layer names (peft's suffix match); null: every Linear and Conv
    ranks: Optional[List[int]] = None  # heterogeneous ranks: client c trains at rank ranks[c % len(ranks)]
    dropout: float = 0.0  # lora_dropout
    rslora: bool = False  # use_rslora: scaling alpha / sqrt(r)
    base: Optional[str] = None  # a state_dict file (torch.save) of the base model's pretrained weights


_SECTIONS[(RunConfig, "lora")] = LoraConfig
RANGES.update({"lora.r": ">= 1", "lora.alpha": "> 0", "lora.dropout": "[0, 1)"})


def lora_config_errors(cfg: RunConfig) -> List[str]:
    """The ``lora.*`` checks (one line each; fedkernels.sim.lora)."""
    from .lora import config_errors

    return config_errors(cfg)
