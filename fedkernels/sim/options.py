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

from typing import Any, Dict, List, Mapping, Optional, Tuple

from .. import algorithms

# the signature reading and the type checks live with the algorithms (fedkernels.algorithms.signature);
# this module adds the config's vocabulary and keys. _hints is re-exported for sim.checks.
from ..algorithms.signature import _hints  # noqa: F401
from ..algorithms.signature import describe, normalize_value, signature_params
from ..algorithms.signature import expected as _expected, fmt_value as _fmt_value, matches as _matches
from ..algorithms.signature import is_float_text, is_real
from ..algorithms.wrappers import WRAPPERS, wrapper_options
from .config import _suggest, in_range, range_words


def _describe(ann) -> str:
    """The expected type in the config file's words (null, true/false)."""
    return describe(ann, yaml=True)


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
        raise ValueError(
            f"{where}={name!r}: unknown algorithm; {_suggest(key, reg, _INLINE)}known: {', '.join(sorted(reg))}"
        )
    return reg[key]


def option_range(cls: type, key: str) -> Optional[str]:
    """The range of numeric option ``key`` of aggregator class ``cls`` (None: not range-checked here): what
    the class, or the nearest base that declares it, says in ``option_ranges`` (``Aggregator.option_ranges``)."""
    for klass in cls.__mro__:
        spec = vars(klass).get("option_ranges", {}).get(key)
        if spec is not None:
            return spec
    return None


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
    params = {**signature_params(cls), **wrapper_options()}  # a method's options, and the wrappers' (norm_bound)
    for key, val in options.items():
        if key not in params:
            raise ValueError(
                f"{_key(where, key)}={_fmt_value(val)}: unknown option of {name}; "
                f"{_suggest(key, params, _INLINE)}options: {', '.join(params)}"
            )
        ann, default = params[key]
        exp = _expected(ann, default)
        if default is None and exp is not None and val is None:
            continue
        if not _matches(val, exp):
            raise ValueError(f"{_key(where, key)}={_fmt_value(val)}: {name} expects {_describe(exp)}")
        spec = option_range(WRAPPERS.get(key, cls), key)
        if spec is not None and (is_real(val) or is_float_text(val)) and not in_range(float(val), spec):
            raise ValueError(f"{_key(where, key)}={_fmt_value(val)}: {name} expects a number {range_words(spec)}")


def normalize_options(name: str, options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``options`` with number text for float parameters (``'1e-3'``) converted to float."""
    params = {**signature_params(algorithm_class(name)), **wrapper_options()}
    return {k: normalize_value(v, _expected(*params[k])) if k in params else v for k, v in (options or {}).items()}


def check_algorithm(
    name: str, options: Optional[Mapping[str, Any]] = None, where: str = "algorithm", construct: bool = True
) -> None:
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
        msg = " ".join(str(e).split())  # one line
        if msg.lower().startswith(name.lower() + ":"):
            msg = msg[len(name) + 1 :].lstrip()
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
        raise ValueError(
            f"method {spec!r}: not a preset method or registered algorithm; {hint}"
            f"{lab}algorithms: {', '.join(sorted(_registry()))}"
        )
    check_algorithm(var["name"], var.get("options") or {}, where=f"method {label!r}")
    return label, var
