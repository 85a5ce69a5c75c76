"""An aggregator's options, read from its constructor's signature: names, expected types, defaults.

``build(name, **options)`` checks the options here before it constructs anything:

* an unknown name gets one line with a close-match suggestion and the list of valid options;
* a value is checked against the parameter's annotation (``int``, ``float``, ``bool``, ``str``,
  ``Optional``, ``Union``, ``Literal``, sequences, classes) or, without one, against the type of its
  default; the message names the method, the option, the value and the expected type;
* number text for a float option (``"1e-3"``; YAML 1.1 reads such numbers as strings) becomes a float.

The constructor's own checks (choices, ranges) run after these. ``fedkernels.sim.options`` reuses
the same functions for configs and the command line (with YAML's words: null, true/false).

Options are followed up the class hierarchy while an ``__init__`` forwards ``**kw``
(``on_bad_update`` and ``server_lr`` live on :class:`~fedkernels.algorithms.Aggregator`).
"""

from __future__ import annotations

import collections.abc
import difflib
import functools
import inspect
import numbers
import re
import textwrap
import typing
from typing import Any, Dict, Iterable, Mapping, NamedTuple, Optional, Tuple

NO_DEFAULT = inspect.Parameter.empty


class Option(NamedTuple):
    """One option of a method: the expected type in words, its default, whether it must be given."""

    type: str
    default: Any
    required: bool


def _hints(fn: Any) -> Dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - a forward reference that does not resolve: raw annotations
        return dict(getattr(fn, "__annotations__", {}) or {})


def signature_params(cls: type) -> Dict[str, Tuple[Any, Any]]:
    """``{option: (annotation or None, default or inspect.Parameter.empty)}`` of ``cls(**options)``:
    the keyword parameters of ``cls.__init__`` and, while an ``__init__`` forwards ``**kw``, those
    of its bases. Positional-only and ``*args`` parameters are not options. (Read once per class.)"""
    return dict(_signature_params(cls))


@functools.lru_cache(maxsize=None)
def _signature_params(cls: type) -> Dict[str, Tuple[Any, Any]]:
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
                out[pname] = (None if ann is NO_DEFAULT else ann, p.default)
        if not forwards:
            break
    return out


# ---- value checks -----------------------------------------------------------------------------------
def is_real(v: Any) -> bool:
    """A real number (Python, NumPy), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_integer(v: Any) -> bool:
    """An integer (Python, NumPy), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_float_text(v: Any) -> bool:
    """Text that ``float()`` parses (``"1e-3"``, ``"inf"``)."""
    if not isinstance(v, str):
        return False
    try:
        float(v)
    except ValueError:
        return False
    return True


def describe(ann: Any, yaml: bool = False) -> str:
    """The expected type in words: 'a number', "one of 'a', 'b'", 'a number or None' ...
    ``yaml`` uses the config file's words (null, true/false)."""
    if ann is None or ann is Any:
        return "any value"
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is typing.Union:
        parts = [describe(a, yaml) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null" if yaml else "None")
        return " or ".join(parts)
    if origin in (list, tuple, collections.abc.Sequence, collections.abc.MutableSequence):
        inner = describe(args[0], yaml) if args else "any value"
        return f"a list (of {inner})" if args else "a list"
    if origin in (dict, collections.abc.Mapping):
        return "a mapping"
    if ann is bool:
        return "a bool (true/false)" if yaml else "a bool (True/False)"
    if ann is int:
        return "an integer"
    if ann is float:
        return "a number"
    if ann is str:
        return "a string"
    if origin is collections.abc.Callable or ann is collections.abc.Callable:
        return "a callable (Python API only)" if yaml else "a callable"
    name = getattr(ann, "__name__", str(ann))
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def matches(v: Any, ann: Any) -> bool:
    """Whether ``v`` is a value of type ``ann`` (number text counts as a float)."""
    if ann is None or ann is Any:
        return True
    if isinstance(ann, str):  # an annotation that did not resolve: do not guess
        return True
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return any(v == a and type(v) is type(a) for a in args) or (
            isinstance(v, str) and v in [a for a in args if isinstance(a, str)]
        )
    if origin is typing.Union:
        return any(matches(v, a) for a in args)
    if ann is type(None):
        return v is None
    if ann is bool:
        return isinstance(v, bool)
    if ann is int:
        return is_integer(v)
    if ann is float:
        return is_real(v) or is_float_text(v)
    if ann is str:
        return isinstance(v, str)
    if origin in (list, tuple, collections.abc.Sequence, collections.abc.MutableSequence):
        if not isinstance(v, (list, tuple)):
            return False
        if args and args[-1] is not Ellipsis:
            if origin is tuple and len(args) > 1:
                return len(v) == len(args) and all(matches(x, a) for x, a in zip(v, args))
            return all(matches(x, args[0]) for x in v)
        return True
    if origin in (dict, collections.abc.Mapping):
        return isinstance(v, Mapping)
    if origin is collections.abc.Callable or ann is collections.abc.Callable:
        return callable(v)
    if isinstance(ann, type):
        return isinstance(v, ann)
    return True  # TypeVar, Protocol ...: not checkable here


def expected(ann: Any, default: Any) -> Any:
    """The annotation to check against: the declared one, else the type of the default."""
    if ann is not None and ann is not Any:
        return ann
    if default is NO_DEFAULT or default is None:
        return None
    for tp in (bool, int, float, str):
        if isinstance(default, tp):
            return tp
    return None


def _drop_float(ann: Any) -> Any:
    """``ann`` without its float members (``NoneType`` when nothing is left)."""
    if typing.get_origin(ann) is typing.Union:
        rest = tuple(a for a in typing.get_args(ann) if a is not float)
        return typing.Union[rest] if rest else type(None)
    return type(None) if ann is float else ann


def _accepts_float(ann: Any) -> bool:
    if ann is float:
        return True
    if typing.get_origin(ann) is typing.Union:
        return any(_accepts_float(a) for a in typing.get_args(ann))
    return False


def normalize_value(v: Any, ann: Any) -> Any:
    """``v`` as the constructor expects it: number text as a float where ``ann`` takes a float and
    no str member of ``ann`` takes the text as it is; a NumPy integer or float as a Python one."""
    if is_float_text(v) and _accepts_float(ann) and not matches(v, _drop_float(ann)):
        return float(v)
    if is_integer(v) and not isinstance(v, int):
        return int(v)
    if is_real(v) and not isinstance(v, (int, float)) and _accepts_float(ann):
        return float(v)
    return v


def fmt_value(v: Any) -> str:
    """A value in a message: text quoted, anything else as printed, on one line, at most 200 characters."""
    return " ".join((repr(v) if isinstance(v, str) else str(v)).split())[:200]


def suggest(word: Any, choices: Iterable[Any], fmt: str = "did you mean {!r}? ") -> str:
    """``fmt`` filled with the closest of ``choices`` to ``word`` (difflib's default cutoff), or ""."""
    m = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return fmt.format(m[0]) if m else ""


def unknown_option(method: str, params: Iterable[str], key: str, value: Any) -> str:
    """The one line for an option the method does not have."""
    params = list(params)
    return f"{method}: unknown option {key}={fmt_value(value)}; {suggest(key, params)}options: {', '.join(params)}"


# ---- the library's entry point ------------------------------------------------------------------------
def options(cls: Any) -> Dict[str, Option]:
    """``{option: Option(type, default, required)}`` of aggregator class ``cls`` (empty for a
    registered factory that is not a class: its options cannot be read)."""
    out: Dict[str, Option] = {}
    if not isinstance(cls, type):
        return out
    for key, (ann, default) in signature_params(cls).items():
        exp = expected(ann, default)
        out[key] = Option(describe(exp), None if default is NO_DEFAULT else default, default is NO_DEFAULT)
    return out


def check_options(method: str, cls: Any, opts: Mapping[str, Any], required: bool = True) -> Dict[str, Any]:
    """``opts`` checked against the constructor of ``cls`` (ValueError, one line, naming the method,
    the option, the value and the expected type); returns them with number text for float options
    converted. ``required``: also report a parameter without default that ``opts`` lacks. A
    registered factory that is not a class is passed through unchecked."""
    out = dict(opts)
    if not isinstance(cls, type):
        return out
    params = signature_params(cls)
    for key, val in out.items():
        if key not in params:
            raise ValueError(unknown_option(method, params, key, val))
        ann, default = params[key]
        exp = expected(ann, default)
        if default is None and val is None:
            continue
        if not matches(val, exp):
            raise ValueError(
                f"{method}: option {key}={fmt_value(val)}: expected {describe(exp)}, got {type(val).__name__}"
            )
        out[key] = normalize_value(val, exp)
    missing = [k for k, (_, default) in params.items() if required and default is NO_DEFAULT and k not in out]
    if missing:
        k = missing[0]
        raise ValueError(
            f"{method}: option {k} is required ({describe(expected(*params[k]))}); options: {', '.join(params)}"
        )
    return out


def _first_sentence(doc: Optional[str]) -> str:
    para = " ".join((doc or "").strip().split("\n\n", 1)[0].split())
    end = re.search(r"\.\s(?=[A-Z`(])", para)  # not at "Fig. 9"
    return para if end is None else para[: end.start() + 1]


def method_table(registry: Mapping[str, Any], base_options: Iterable[str] = ()) -> str:
    """The registered methods as text for ``build``'s docstring: names (aliases), the class, the
    first line of its docstring and the options with their defaults (``base_options``, common to
    all, left out)."""
    base = set(base_options)
    names: Dict[Any, list] = {}
    for key in sorted(registry):
        names.setdefault(registry[key], []).append(key)
    lines = []
    for cls, keys in names.items():
        where = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
        lines += textwrap.wrap(
            f"``{', '.join(keys)}`` ({where}): {_first_sentence(cls.__doc__)}",
            96,
            initial_indent="    ",
            subsequent_indent="        ",
            break_on_hyphens=False,
        )
        if isinstance(cls, type):
            own = [
                f"{k}={default!r}" if default is not NO_DEFAULT else f"{k} (required)"
                for k, (_, default) in signature_params(cls).items()
                if k not in base
            ]
            lines += textwrap.wrap(
                "options: " + (", ".join(own) if own else "(only the common ones)"),
                96,
                initial_indent="        ",
                subsequent_indent="            ",
                break_on_hyphens=False,
            )
    return "\n".join(lines)
