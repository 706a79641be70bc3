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

import math
from collections.abc import Iterable
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
