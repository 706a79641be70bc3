"""Argument checks at the public boundary: each raises one :class:`~trainledger.errors.InputError` line that
names the bad value and what is accepted. No torch import.

Library messages name quantities in words ("sequence length", "world size"), never command-line flags:
the same check serves Python callers and the command line.

The plausibility limits live here, each with the reason it was chosen, so that a size no machine or
model comes near is refused in one line instead of exhausting memory or time.

Example:
    >>> whole_number(8, "world size")
    8
    >>> whole_number("8", "world size")
    Traceback (most recent call last):
    ...
    trainledger.errors.InputError: world size '8' is a str; give a whole number (at least 1)
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from trainledger.errors import InputError


@dataclass(frozen=True)
class Limit:
    """The largest value accepted for a quantity, and why no real setup comes near it."""

    value: int
    why: str


MAX_PARAMS = Limit(10**15, "a thousand times the largest models trained, about 10^12 parameters")
MAX_BYTES = Limit(2**60, "1 EiB, more memory than any machine has")
MAX_SEQ_LEN = Limit(2**24, "above the longest context any model trains with, about 10^7 tokens")
MAX_MICRO_BATCH = Limit(2**16, "sequences on one device; far beyond any micro-batch that fits one")
MAX_LAYERS = Limit(1024, "the deepest transformers trained have about 1,000 layers")
MAX_WORLD = Limit(2**53, "the most ranks a JSON reader counts exactly; identical ranks are computed once")
MAX_LATENT_SIDE = Limit(2**14, "latent pixels per side; 16,384 is a 131,072-pixel image at the usual 8x")
MAX_WIDTH = Limit(2**20, "over ten times the widest published layer, PaLM's 73,728")
MAX_VOCAB = Limit(2**22, "over ten times the largest vocabularies, about 256,000 tokens")
MAX_EXPERTS = Limit(2**12, "over ten times the most experts a published mixture uses")
MAX_BUDGETS = Limit(64, "each budget is a MILP solve, and with verification a traced step; 64 draw the curve finely")


def whole_number(value: Any, what: str, *, minimum: int = 1, limit: Limit | None = None, minimum_why: str = "") -> int:
    """``value`` if it is an ``int`` (not a ``bool``) in ``[minimum, limit]``; else one clear line.

    ``what`` names the quantity in words (``"world size"``); empty when the caller names it already.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{what} {value!r} is a {type(value).__name__}; give a whole number (at least {minimum})")
    if value < minimum:
        why = f" ({minimum_why})" if minimum_why else ""
        raise InputError(f"{what} {value:,} must be at least {minimum:,}{why}".lstrip())
    if limit is not None and value > limit.value:
        raise InputError(f"{what} {value:,} is more than {limit.value:,}, the most accepted ({limit.why})".lstrip())
    return value


def positive_number(value: Any, what: str, *, unit: str = "") -> float:
    """A finite number above zero (``int`` or ``float``, not ``bool``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise InputError(f"{what} {value!r} must be a finite number above 0" + (f" ({unit})" if unit else ""))
    return float(value)


def one_of(value: Any, what: str, accepted: Iterable[str]) -> str:
    """``value`` if it is one of the ``accepted`` strings."""
    names = tuple(accepted)
    if not isinstance(value, str) or value not in names:
        raise InputError(f"unknown {what} {value!r}; accepted: {', '.join(names)}")
    return value


def instance_of(value: Any, types: type | tuple[type, ...], what: str, accepted: str) -> Any:
    """``value`` if it is an instance of ``types``; otherwise name what it is and what is accepted."""
    if not isinstance(value, types):
        raise InputError(f"{what} is {describe(value)}; {accepted}")
    return value


def describe(value: Any) -> str:
    """A short description of a value for an error message: ``None``, ``the class Linear``, ``a str 'adam'``."""
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__name__} (not an instance)"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name} {text}" if isinstance(value, (str, int, float)) else f"{article} {name}"


# --- results read back from JSON --------------------------------------------------------------------------


def fields_of_their_types(result: Any, what: str) -> None:
    """Check that a dataclass read back from JSON holds, in every field, a value of the type the field
    declares: through nested dataclasses, tuples, lists and dicts; a ``float`` field takes an ``int``.

    A saved file edited by hand (``"device": null``, ``"budget_bytes": "big"``) is refused here, in one
    line naming the field, instead of failing wherever the value is first used.

    Example:
        >>> @dataclass(frozen=True)
        ... class Peak:
        ...     bytes: int
        ...     phase: str | None = None
        >>> fields_of_their_types(Peak(8, "forward"), "peak")
        >>> fields_of_their_types(Peak("big"), "peak")
        Traceback (most recent call last):
        ...
        trainledger.errors.InputError: peak.bytes is a str 'big', not int
    """
    problem = _checker(type(result))(result, what)
    if problem:
        raise InputError(problem)


_Check = Callable[[Any, str], "str | None"]
"""Why a value (at the place named) is not of a type, or ``None``; made once per type (:func:`_checker`)."""


def _no_problem(_value: Any, _where: str) -> None:
    return None


@functools.cache
def _checker(hint: Any) -> _Check:
    """The check of values of ``hint``: its top level, then what is inside a container or a dataclass."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arms = [(_is_a(arm), _checker(arm)) for arm in typing.get_args(hint)]

        def check_union(value: Any, where: str) -> str | None:
            for is_arm, check_arm in arms:
                if is_arm(value):
                    return check_arm(value, where)
            return f"{where} is {describe(value)}, not {_type_name(hint)}"

        return check_union
    is_hint, inside = _is_a(hint), _inside(hint)

    def check(value: Any, where: str) -> str | None:
        if not is_hint(value):
            return f"{where} is {describe(value)}, not {_type_name(hint)}"
        return inside(value, where)

    return check


def _is_a(hint: Any) -> Callable[[Any], bool]:
    """Whether a value is a ``hint`` at its top level (what is inside a container is not looked at); a union
    is taken apart by :func:`_checker`, so ``hint`` is none."""
    origin = typing.get_origin(hint) or hint
    if hint is Any or isinstance(hint, (typing.TypeVar, str, typing.ForwardRef)):
        return lambda _v: True
    if hint is None or hint is type(None):
        return lambda v: v is None
    if origin is typing.Literal:
        accepted = typing.get_args(hint)
        return lambda v: v in accepted
    if hint is float:
        return lambda v: type(v) is float or (isinstance(v, (int, float)) and not isinstance(v, bool))
    if hint is int:
        return lambda v: type(v) is int or (isinstance(v, int) and not isinstance(v, bool))
    if isinstance(origin, type):
        return lambda v: isinstance(v, origin)
    return lambda _v: True  # a typing form not checked here (a Callable, a Protocol)


def _inside(hint: Any) -> _Check:
    """The check of what a value of ``hint`` holds: items, keys and values, a dataclass's fields."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _check_fields
    variadic = origin in (list, collections.abc.Sequence) or (origin is tuple and args[-1:] == (...,))
    if variadic and args:
        item = _checker(args[0])

        def check_items(value: Any, where: str) -> str | None:
            for i, v in enumerate(value):
                if problem := item(v, f"{where}[{i}]"):
                    return problem
            return None

        return check_items
    if origin is tuple and args:
        items = [_checker(a) for a in args]

        def check_fixed(value: Any, where: str) -> str | None:
            if len(value) != len(items):
                return f"{where} holds {len(value)} items, not {len(items)}"
            return next(
                (p for i, (c, v) in enumerate(zip(items, value, strict=True)) if (p := c(v, f"{where}[{i}]"))), None
            )

        return check_fixed
    if origin in (dict, collections.abc.Mapping) and len(args) == 2:
        key, item = _checker(args[0]), _checker(args[1])

        def check_mapping(value: Any, where: str) -> str | None:
            for k, v in value.items():
                if problem := key(k, f"{where} key") or item(v, f"{where}[{k!r}]"):
                    return problem
            return None

        return check_mapping
    return _no_problem


def _check_fields(value: Any, where: str) -> str | None:
    for name, check in _field_checks(type(value)):
        if problem := check(getattr(value, name), f"{where}.{name}"):
            return problem
    return None


@functools.cache
def _field_checks(cls: type) -> tuple[tuple[str, _Check], ...]:
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # a name imported only for type checkers: its fields go unchecked
        return ()
    return tuple((f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls) if f.name in hints)


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "")


def unreadable_json(exc: RecursionError | ValueError) -> str:
    """Why ``json.loads`` refused text that is JSON: nested too deeply, or an integer of thousands of digits
    (Python's limit on converting digits)."""
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(":")[0]
