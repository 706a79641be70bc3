"""A memory budget as the user gives it: a share of the plain step's traced peak, or a size.

Parsed once, where it enters (the command line, or :func:`~trainledger.remat.plan`); the planner resolves
it against the plain peak once that is traced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainledger.errors import InputError
from trainledger.units import SizeSyntaxError, parse_size

_PERCENT = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*%\s*$")
_BARE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*$")
MAX_PERCENT = 10_000.0
"""The largest percentage accepted: from 100% on nothing is recomputed, and far above it is a typo."""
_NOT_UNDERSTOOD = "use a percentage of the plain peak (60%) or a size (2GiB, 512MiB, bytes)"


@dataclass(frozen=True, kw_only=True)
class Budget:
    """A budget: exactly one of ``nbytes`` and ``percent`` is set.

    Example:
        >>> Budget.parse("50%").resolve(1000), Budget.parse("1KiB").resolve(1000)
        (500, 1024)
    """

    nbytes: int | None = None
    """An absolute size in bytes."""
    percent: float | None = None
    """A percentage of the plain step's traced peak (``60.0`` for ``60%``)."""

    def __post_init__(self) -> None:
        assert (self.nbytes is None) != (self.percent is None), self

    @classmethod
    def parse(cls, value: str | int | Budget) -> Budget:
        """``60%`` of the plain peak, or a size: ``2GiB``, ``512MiB``, ``1e9``, plain bytes (an int)."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise InputError(
                f"budget {value!r} is a {type(value).__name__}; give a percentage of the plain peak ('60%') "
                "or a size ('2GiB', or bytes as an int)"
            )
        if isinstance(value, str):
            m = _PERCENT.match(value)
            if m:
                share = float(m.group(1))
                if share <= 0:
                    raise InputError(f"budget {value!r} must be a positive percentage of the plain peak")
                if share > MAX_PERCENT:
                    raise InputError(
                        f"budget {value!r} is more than {MAX_PERCENT:,.0f}% of the plain peak; any budget from 100% "
                        "on recomputes nothing"
                    )
                return cls(percent=share)
            if value.strip().endswith("%"):
                raise InputError(f"budget {value!r} is not understood; {_NOT_UNDERSTOOD}")
            bare = _BARE.match(value)
            if bare and float(bare.group(1)) <= 0:
                raise InputError(f"budget {value!r} must be positive: a share of the plain peak (60%) or a size (2GiB)")
            if bare and float(bare.group(1)) <= 100:  # no step fits in 100 bytes: a percentage without its sign
                number = value.strip()
                raise InputError(
                    f"budget {value!r} would be {number} byte{'' if float(number) == 1 else 's'}; give {number}% for a "
                    f"share of the plain peak, or a size with its unit ({number}MiB)"
                )
        try:
            return cls(nbytes=parse_size(value))
        except SizeSyntaxError:
            raise InputError(f"budget {value!r} is not understood; {_NOT_UNDERSTOOD}") from None
        except InputError as exc:  # a size out of range keeps its own message (it says the range)
            raise InputError(f"budget: {exc}") from None

    def resolve(self, plain_peak_bytes: int) -> int:
        """The budget in bytes, given the plain step's traced peak."""
        if self.percent is not None:
            return int(plain_peak_bytes * self.percent // 100)
        assert self.nbytes is not None
        return self.nbytes
