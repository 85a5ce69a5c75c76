"""Validation of an algorithm name and its options before anything is computed or written.

    check_algorithm("kuramoto", {"mode": "S", "kappa0": 0.5})      # None, or ValueError (one line)
    check_method("kuramoto-S0.5", presets.variants("kuramoto-fmnist"))  # -> (label, variant)

The options are checked against the aggregator constructor's signature, following ``**kw`` up the
class hierarchy (``on_bad_update`` and ``server_lr`` live on the base class): an unknown key gets a
close-match suggestion, a value is checked against the parameter's annotation (``int``, ``float``,
``bool``, ``str``, ``Optional``, ``Union``, ``Literal``, sequences) or, without one, against the
type of its default. Then the aggregator is built once with those options, so that the
constructor's own checks (choices, ranges) run now and not after the data are loaded. Every error
is one line naming the key, the value and what was expected.

Numbers written as ``1e-3`` on the command line reach us as text (YAML 1.1 reads them as strings);
a float parameter accepts such text when ``float()`` parses it, and :func:`normalize_options`
returns the options with that text converted.
"""
from __future__ import annotations

import collections.abc
import inspect
import typing
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .. import algorithms
from .config import _suggest, in_range, range_words

_NO_DEFAULT = inspect.Parameter.empty


def _registry() -> Dict[str, type]:
    # the registry has no public class lookup (algorithms.build constructs); read it here only
    from ..algorithms import base
    return base._REGISTRY


# the close-match hint inside these messages ("...: unknown option of x; did you mean 'y'? options: ...")
_INLINE = "did you mean {!r}? "


def algorithm_class(name: Any, where: str = "algorithm.name") -> type:
    """The aggregator class registered as ``name``; ValueError (one line) for an unknown name."""
    reg = _registry()
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}={name!r}: expected an algorithm name (known: {', '.join(sorted(reg))})")
    key = name.lower()
    if key not in reg:
        raise ValueError(f"{where}={name!r}: unknown algorithm; {_suggest(key, reg, _INLINE)}"
                         f"known: {', '.join(sorted(reg))}")
    return reg[key]


def _hints(fn) -> Dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - a forward reference that does not resolve: raw annotations
        return dict(getattr(fn, "__annotations__", {}) or {})


def signature_params(cls: type) -> Dict[str, Tuple[Any, Any]]:
    """``{option: (annotation or None, default or inspect.Parameter.empty)}`` of ``cls(**options)``:
    the keyword parameters of ``cls.__init__`` and, while an ``__init__`` forwards ``**kw``, those
    of its bases. Positional-only and ``*args`` parameters are not options."""
    out: Dict[str, Tuple[Any, Any]] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            break
        sig = inspect.signature(init)
        hints = _hints(init)
        forwards = False
        for i, (pname, p) in enumerate(sig.parameters.items()):
            if i == 0 and pname == "self":
                continue
            if p.kind is p.VAR_KEYWORD:
                forwards = True
                continue
            if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
                continue
            if pname not in out:
                ann = hints.get(pname, p.annotation)
                out[pname] = (None if ann is _NO_DEFAULT else ann, p.default)
        if not forwards:
            break
    return out


# ---- value checks -----------------------------------------------------------------------------------
def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _float_text(v) -> bool:
    if not isinstance(v, str):
        return False
    try:
        float(v)
    except ValueError:
        return False
    return True


def _describe(ann) -> str:
    """'a float', 'one of 'a', 'b'', 'a float or null' ..."""
    if ann is None or ann is Any:
        return "any value"
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is typing.Union:
        parts = [_describe(a) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " or ".join(parts)
    if origin in (list, tuple, collections.abc.Sequence, collections.abc.MutableSequence):
        inner = _describe(args[0]) if args else "any value"
        return f"a list (of {inner})" if args else "a list"
    if origin in (dict, collections.abc.Mapping):
        return "a mapping"
    if ann is bool:
        return "a bool (true/false)"
    if ann is int:
        return "an integer"
    if ann is float:
        return "a number"
    if ann is str:
        return "a string"
    if origin is collections.abc.Callable or ann is collections.abc.Callable:
        return "a callable (Python API only)"
    return f"a {getattr(ann, '__name__', str(ann))}"


def _matches(v, ann) -> bool:
    if ann is None or ann is Any:
        return True
    if isinstance(ann, str):          # an annotation that did not resolve: do not guess
        return True
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return any(v == a and type(v) is type(a) for a in args) or (
            isinstance(v, str) and v in [a for a in args if isinstance(a, str)])
    if origin is typing.Union:
        return any(_matches(v, a) for a in args)
    if ann is type(None):
        return v is None
    if ann is bool:
        return isinstance(v, bool)
    if ann is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if ann is float:
        return (_is_real(v) or _float_text(v))
    if ann is str:
        return isinstance(v, str)
    if origin in (list, tuple, collections.abc.Sequence, collections.abc.MutableSequence):
        if not isinstance(v, (list, tuple)):
            return False
        if args and args[-1] is not Ellipsis:
            if origin is tuple and len(args) > 1:
                return len(v) == len(args) and all(_matches(x, a) for x, a in zip(v, args))
            return all(_matches(x, args[0]) for x in v)
        return True
    if origin in (dict, collections.abc.Mapping):
        return isinstance(v, Mapping)
    if origin is collections.abc.Callable or ann is collections.abc.Callable:
        return callable(v)
    if isinstance(ann, type):
        return isinstance(v, ann)
    return True                        # TypeVar, Protocol ...: not checkable here


def _expected(ann, default) -> Any:
    """The annotation to check against: the declared one, else the type of the default."""
    if ann is not None and ann is not Any:
        return ann
    if default is _NO_DEFAULT or default is None:
        return None
    if isinstance(default, bool):
        return bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    if isinstance(default, str):
        return str
    return None


# The ranges of the numeric options that the aggregators' constructors do not check themselves (the
# others are checked there, when check_algorithm builds the aggregator once), by the class that
# declares the option (looked up through the MRO: subclasses share it); "> a", "[a, b)" as config.RANGES.
OPTION_RANGES: Dict[str, Dict[str, str]] = {
    "Aggregator": {"server_lr": "> 0"},
    "ControlVariateServer": {"num_clients": ">= 1"},
    "FedAWARE": {"max_iter": ">= 1"},
    "FedECADO": {"hutchinson_probes": ">= 1", "hutchinson_batches": ">= 1", "num_clients": ">= 1"},
    "FedPGVC": {"lam": ">= 0", "tau": "> 0", "code_eta": "> 0"},
    "GCFed": {"lam": "[0, 1]", "weight_decay": ">= 0", "momentum": "[0, 1)"},
}


def option_range(cls: type, key: str) -> Optional[str]:
    """The range of numeric option ``key`` of aggregator class ``cls`` (None: not range-checked here)."""
    for klass in cls.__mro__:
        spec = OPTION_RANGES.get(klass.__name__, {}).get(key)
        if spec is not None:
            return spec
    return None


def _fmt_value(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _key(where: str, key: Optional[str] = None) -> str:
    """``algorithm.options.KEY`` for a config, ``method 'LABEL': option KEY`` for compare."""
    if where == "algorithm" or "." in where or " " not in where:
        return f"{where}.options" + (f".{key}" if key is not None else "")
    return f"{where}: " + (f"option {key}" if key is not None else "options")


def _check_options(name: str, cls: type, options: Mapping[str, Any], where: str) -> None:
    if options is None:
        return
    if not isinstance(options, Mapping):
        raise ValueError(f"{_key(where)}={options!r}: expected a mapping of option names to values")
    params = signature_params(cls)
    for key, val in options.items():
        if key not in params:
            raise ValueError(f"{_key(where, key)}={_fmt_value(val)}: unknown option of {name}; "
                             f"{_suggest(key, params, _INLINE)}options: {', '.join(params)}")
        ann, default = params[key]
        exp = _expected(ann, default)
        if default is None and exp is not None and val is None:
            continue
        if not _matches(val, exp):
            raise ValueError(f"{_key(where, key)}={_fmt_value(val)}: {name} expects {_describe(exp)}")
        spec = option_range(cls, key)
        if spec is not None and (_is_real(val) or _float_text(val)) and not in_range(float(val), spec):
            raise ValueError(f"{_key(where, key)}={_fmt_value(val)}: {name} expects a number {range_words(spec)}")


def normalize_options(name: str, options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``options`` with number text for float parameters (``'1e-3'``) converted to float."""
    params = signature_params(algorithm_class(name))
    out = dict(options or {})
    for k, v in out.items():
        if k in params and _float_text(v):
            exp = _expected(*params[k])
            if _accepts_float(exp) and not _matches(v, _drop_float(exp)):
                out[k] = float(v)
    return out


def _drop_float(ann):
    """``ann`` without its float members (None when nothing is left)."""
    if typing.get_origin(ann) is typing.Union:
        rest = tuple(a for a in typing.get_args(ann) if a is not float)
        return typing.Union[rest] if rest else type(None)
    return type(None) if ann is float else ann


def _accepts_float(ann) -> bool:
    if ann is float:
        return True
    if typing.get_origin(ann) is typing.Union:
        return any(_accepts_float(a) for a in typing.get_args(ann))
    return False


def check_algorithm(name: str, options: Optional[Mapping[str, Any]] = None, where: str = "algorithm",
                    construct: bool = True) -> None:
    """Validates an algorithm name against the registry and ``options`` against its constructor.

    ``where`` prefixes the key in the message (``algorithm.options.kappa0=...``; ``compare`` passes
    ``method 'LABEL'``). With ``construct`` (default) the aggregator is then built once with the
    options so that its own range and choice checks run too. Raises ValueError with one line."""
    cls = algorithm_class(name, f"{where}.name" if where == "algorithm" else f"{where}: algorithm")
    _check_options(name, cls, options, where)
    opts = dict(options or {})
    if not construct:
        return
    try:
        algorithms.build(name, **normalize_options(name, opts))
    except (ValueError, TypeError) as e:
        msg = " ".join(str(e).split())      # one line
        if msg.lower().startswith(name.lower() + ":"):
            msg = msg[len(name) + 1:].lstrip()
        raise ValueError(f"{_key(where)} ({name}): {msg}") from None


def check_method(spec: str, known: Optional[Mapping[str, Dict[str, Any]]] = None) -> Tuple[str, Dict[str, Any]]:
    """A ``compare``/``run`` method: a preset variant label, an algorithm name or
    ``algo:key=value:...`` -> ``(label, {"name", "options"})``, validated (ValueError naming it)."""
    from . import presets
    known = dict(known or {})
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method {spec!r}: expected a preset method label, an algorithm name or algo:key=value")
    try:
        label, var = presets.parse_method(spec, known)
    except ValueError as e:
        raise ValueError(" ".join(str(e).split())) from None
    base = spec.split(":", 1)[0].strip()
    if var["name"].lower() not in _registry():
        pool: List[str] = sorted(set(known) | set(_registry()))
        hint = _suggest(base, pool, _INLINE)
        lab = f"preset methods: {', '.join(known)}; " if known else ""
        raise ValueError(f"method {spec!r}: not a preset method or registered algorithm; {hint}"
                         f"{lab}algorithms: {', '.join(sorted(_registry()))}")
    check_algorithm(var["name"], var.get("options") or {}, where=f"method {label!r}")
    return label, var
