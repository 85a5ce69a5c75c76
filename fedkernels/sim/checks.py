"""Checks of a whole run config before anything is computed or written: the free-form ``options``
of the algorithm, data set, partition and model against the signature of what they configure
(unknown key with a close-match suggestion, wrong type against the default's type), one line each.

    check_run(cfg)     # ValueError("algorithm.options.kapa0: unknown option ... (did you mean 'kappa0'?)")
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from .config import RunConfig, _suggest
from .. import algorithms
from .options import _describe, _expected, _hints, _matches, check_algorithm, normalize_options, signature_params

__all__ = ["check_run", "check_kwargs"]


def _params(fn: Callable) -> Dict[str, Tuple[Any, Any]]:
    """``{name: (annotation, default)}`` of the keyword parameters of a function or of a class's
    constructor (through the ``**kw`` chain, :func:`fedkernels.sim.options.signature_params`)."""
    if inspect.isclass(fn):
        return signature_params(fn)
    hints = _hints(fn)
    return {
        n: (hints.get(n), p.default)
        for n, p in inspect.signature(fn).parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def check_kwargs(
    where: str, fn: Callable, options: Dict[str, Any], skip: Iterable[str] = (), var_kw: Optional[bool] = None
) -> None:
    """Every key of ``options`` must be a keyword parameter of ``fn`` (a function or a class),
    unless ``fn`` takes ``**kwargs`` (``var_kw`` overrides), and match its annotation (or its
    default's type); ValueError naming ``where.key``, the value and what was expected otherwise."""
    params = {n: v for n, v in _params(fn).items() if n not in skip}
    if var_kw is None:
        var_kw = not inspect.isclass(fn) and any(
            p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()
        )
    for k, v in options.items():
        if k not in params:
            if var_kw:
                continue
            raise ValueError(
                f"{where}.{k}: unknown option (value {v!r}){_suggest(k, list(params))}; "
                f"valid: {', '.join(params) or 'none'}"
            )
        ann, default = params[k]
        exp = _expected(ann, default)
        if v is None and default is None:
            continue
        if not _matches(v, exp):
            raise ValueError(f"{where}.{k}: got {v!r} ({type(v).__name__}), expected {_describe(exp)}")


def check_run(cfg: RunConfig, data_set: bool = True, partition: bool = True, model: bool = True) -> RunConfig:
    """``cfg.validate()`` plus the options of algorithm and, unless the caller supplies them
    (``False``), data set, partition and model."""
    cfg.validate()
    check_algorithm(cfg.algorithm.name, dict(cfg.algorithm.options))  # registry + signature + types
    if cfg.train.steps is not None:  # options that need epochs
        name = cfg.algorithm.name
        why = algorithms.build(name, **normalize_options(name, dict(cfg.algorithm.options))).local_training_conflict(
            cfg.train.steps
        )
        if why:
            raise ValueError(f"train.steps={cfg.train.steps} with algorithm {name}: {why}")
    if cfg.dp.kind is not None:  # the DP wrapper's own checks: the method's verdict, the target epsilon
        _check_dp(cfg)
    if data_set:
        _check_data(cfg)
    if partition:
        from .partition import partition as partition_fn

        check_kwargs(
            "partition.options",
            partition_fn,
            dict(cfg.partition.options),
            skip=("labels", "num_clients", "scheme", "seed"),
        )
    if model:
        _check_model(cfg)
    _check_applies(cfg)
    return cfg


# the partition options each scheme reads (num_classes: every scheme); any other is refused, not ignored
_SCHEME_OPTIONS = {
    "iid": (),
    "shards": ("shards_per_client",),
    "pathological": ("shards_per_client",),
    "label_shards": ("shards_per_client",),
    "natural": ("owners",),
    **{
        k: ("alpha", "convention", "min_size", "max_retries", "balance", "sizes", "prior")
        for k in ("dirichlet", "dir", "hetero_dir")
    },
}


def _check_applies(cfg: RunConfig) -> None:
    """A set option that the chosen scheme or training setup does not read is a one-line ValueError
    (it would be silently ignored): partition options of another scheme, the lr schedule's
    parameters of another schedule, SGD's momentum/nesterov with Adam, hetero ranges while off."""
    scheme = str(cfg.partition.scheme).lower()
    used = _SCHEME_OPTIONS.get(scheme)
    if used is not None:
        for k, v in cfg.partition.options.items():
            if k not in used and k != "num_classes":
                raise ValueError(
                    f"partition.options.{k}={v!r} does not apply to partition.scheme={scheme} "
                    f"(its options: {', '.join(used) or 'none'}); remove it or choose a scheme "
                    "that reads it"
                )
    t, d = cfg.train, RunConfig().train
    for key, schedules in (("lr_min", ("cosine",)), ("lr_step", ("step",)), ("lr_gamma", ("step",))):
        v = getattr(t, key)
        if v != getattr(d, key) and t.lr_schedule not in schedules:
            raise ValueError(
                f"train.{key}={v} does not apply to train.lr_schedule={t.lr_schedule} (it is read by "
                f"lr_schedule={'|'.join(schedules)}); remove it or set train.lr_schedule"
            )
    if t.optimizer == "adam" and (t.momentum or t.nesterov):
        key = "momentum" if t.momentum else "nesterov"
        raise ValueError(f"train.{key}={getattr(t, key)} does not apply to train.optimizer=adam (SGD only); remove it")
    if t.nesterov and not t.momentum:
        raise ValueError(
            "train.nesterov=true needs train.momentum > 0 (Nesterov momentum without momentum is "
            "plain SGD); set train.momentum or remove train.nesterov"
        )
    h = t.hetero
    if not h.enabled:
        for key in ("lr_range", "epochs_range"):
            if getattr(h, key) is not None:
                raise ValueError(
                    f"train.hetero.{key}={getattr(h, key)} is read only with train.hetero.enabled=true; "
                    "set it or remove the range"
                )


def _check_dp(cfg: RunConfig) -> None:
    from ..algorithms.dp import check_dp_options, method_verdict

    name = cfg.algorithm.name
    core = algorithms.build(name, **normalize_options(name, dict(cfg.algorithm.options)))
    label, verdict = method_verdict(core)
    if verdict != "private":
        raise ValueError(f"dp with algorithm {name}: refused: {verdict}")
    if cfg.compress.kind not in (None, "none"):
        raise ValueError(
            f"dp.kind={cfg.dp.kind} with compress.kind={cfg.compress.kind}: refused (the compressed "
            "aggregation path does not clip or noise the rows); use one of them"
        )
    check_dp_options(cfg.dp.options(cfg))


def _check_data(cfg: RunConfig) -> None:
    from . import data

    key = data.dataset_key(cfg.data.name)
    if key not in data.DATASETS:
        raise ValueError(
            f"data.name: unknown dataset {cfg.data.name!r}{_suggest(key, data.DATASETS)}; "
            f"known: {', '.join(data.DATASETS)}"
        )
    if key in data.GENERATED:
        from .data.generated import _GEN_DEFAULTS

        defaults = _GEN_DEFAULTS[key]

        def gen(**kw):  # noqa: ANN001 - a stand-in with the generator's options as its signature
            pass

        gen.__signature__ = inspect.Signature(
            [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in defaults.items()]
            + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in ("max_train", "max_test")]
        )
        check_kwargs("data.options", gen, dict(cfg.data.options))
    else:
        check_kwargs("data.options", data.load_dataset, dict(cfg.data.options), skip=("name",), var_kw=False)


def _check_model(cfg: RunConfig) -> None:
    from .models import _MODEL_ALIASES, MODELS

    mkey = _MODEL_ALIASES.get(cfg.model.name.lower(), cfg.model.name.lower())
    if mkey not in MODELS:
        raise ValueError(
            f"model.name: unknown model {cfg.model.name!r}{_suggest(mkey, sorted(MODELS))}; "
            f"known: {', '.join(sorted(MODELS))}"
        )
    check_kwargs(
        "model.options", MODELS[mkey], dict(cfg.model.options), skip=("num_classes", "in_channels", "input_size")
    )
