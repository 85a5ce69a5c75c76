"""Checks of a whole run config before anything is computed or written: the free-form ``options``
of the algorithm, data set, partition and model against the signature of what they configure
(unknown key with a close-match suggestion, wrong type against the default's type), one line each.

    check_run(cfg)     # ValueError("algorithm.options.kapa0: unknown option ... (did you mean 'kappa0'?)")
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Iterable, Optional

from .config import RunConfig, _suggest

__all__ = ["check_run", "check_kwargs"]

_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _type_error(value: Any, default: Any) -> Optional[str]:
    """What ``value`` should be, judged by the parameter's default (None when it fits)."""
    if default is None or default is inspect.Parameter.empty:
        return None
    t = type(default)
    if t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif t is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif t is str:
        ok = isinstance(value, str)
    else:
        return None
    return None if ok else _WORDS[t]


def _init_params(cls) -> Dict[str, inspect.Parameter]:
    """The keyword parameters of ``cls(...)``, following ``**kw`` passed on to the base classes."""
    out: Dict[str, inspect.Parameter] = {}
    for c in cls.__mro__:
        if "__init__" not in vars(c) or c is object:
            continue
        sig = inspect.signature(vars(c)["__init__"])
        for n, p in sig.parameters.items():
            if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                out.setdefault(n, p)
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            break
    return out


def check_kwargs(where: str, fn: Callable, options: Dict[str, Any], skip: Iterable[str] = (),
                 var_kw: Optional[bool] = None) -> None:
    """Every key of ``options`` must be a keyword parameter of ``fn`` (a function, or a class: its
    constructor through the ``**kw`` chain), unless ``fn`` takes ``**kwargs`` (``var_kw`` overrides),
    and match its default's type; ValueError naming ``where.key``, the value and what was expected."""
    if inspect.isclass(fn):
        params, takes_kw = _init_params(fn), False
    else:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return
        params = {n: p for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        takes_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    params = {n: p for n, p in params.items() if n not in skip}
    var_kw = takes_kw if var_kw is None else var_kw
    for k, v in options.items():
        if k not in params:
            if var_kw:
                continue
            raise ValueError(f"{where}.{k}: unknown option (value {v!r}){_suggest(k, list(params))}; "
                             f"valid: {', '.join(params) or 'none'}")
        want = _type_error(v, params[k].default)
        if want is not None:
            raise ValueError(f"{where}.{k}: got {v!r} ({type(v).__name__}), expected {want}")


def _check_algorithm(name: str, options: Dict[str, Any]) -> None:
    try:   # the outputs engineer's validator (registry + constructor signature + types), when present
        from .options import check_algorithm
    except ImportError:
        check_algorithm = None
    if check_algorithm is not None:
        check_algorithm(name, options)
        return
    from .. import algorithms
    from ..algorithms import base
    key = name.lower()
    if key not in base._REGISTRY:
        raise ValueError(f"algorithm.name: unknown algorithm {name!r}{_suggest(key, algorithms.available())}; "
                         f"known: {', '.join(algorithms.available())}")
    check_kwargs("algorithm.options", base._REGISTRY[key], options)


def check_run(cfg: RunConfig) -> RunConfig:
    """``cfg.validate()`` plus the options of algorithm, data set, partition and model."""
    cfg.validate()
    _check_algorithm(cfg.algorithm.name, dict(cfg.algorithm.options))
    from . import data
    key = data.dataset_key(cfg.data.name)
    if key not in data.DATASETS:
        raise ValueError(f"data.name: unknown dataset {cfg.data.name!r}{_suggest(key, data.DATASETS)}; "
                         f"known: {', '.join(data.DATASETS)}")
    if key in data.GENERATED:
        from .data.generated import _GEN_DEFAULTS
        defaults = _GEN_DEFAULTS[key]

        def gen(**kw):  # noqa: ANN001 - a stand-in with the generator's options as its signature
            pass
        gen.__signature__ = inspect.Signature(
            [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in defaults.items()]
            + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in ("max_train", "max_test")])
        check_kwargs("data.options", gen, dict(cfg.data.options))
    else:
        check_kwargs("data.options", data.load_dataset, dict(cfg.data.options), skip=("name",), var_kw=False)
    from .partition import partition
    check_kwargs("partition.options", partition, dict(cfg.partition.options),
                 skip=("labels", "num_clients", "scheme", "seed"))
    from .models import _MODEL_ALIASES, MODELS
    mkey = _MODEL_ALIASES.get(cfg.model.name.lower(), cfg.model.name.lower())
    if mkey not in MODELS:
        raise ValueError(f"model.name: unknown model {cfg.model.name!r}{_suggest(mkey, sorted(MODELS))}; "
                         f"known: {', '.join(sorted(MODELS))}")
    check_kwargs("model.options", MODELS[mkey], dict(cfg.model.options),
                 skip=("num_classes", "in_channels", "input_size"))
    return cfg
