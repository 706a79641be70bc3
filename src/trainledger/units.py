"""Byte sizes, counts and dtypes: parse what users type, format what they read.

Inside, everything is integer bytes. ``GB`` is 1000³ bytes and ``GiB`` 1024³; formatting says which.
No torch import: dtypes are known by name.
"""

from __future__ import annotations

import re
from decimal import Decimal, localcontext

from trainledger.checks import MAX_BYTES
from trainledger.errors import InputError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_NUMBER = r"([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*([A-Za-z]*)\s*$")
_MAX_EXPONENT = 100  # beyond every limit below; keeps the exact arithmetic small


def _decimal(number: str, what: str, text: object) -> Decimal:
    """The value of a number as typed, exactly (no float rounding: ``1e40`` stays 10^40)."""
    value = Decimal(number)  # the regular expressions let only plain decimal numbers through
    if value.adjusted() > _MAX_EXPONENT:
        raise InputError(f"{what} {text!r} is far too large (more than 10^{_MAX_EXPONENT})")
    return value


def _times(value: Decimal, factor: int) -> Decimal:
    """``value * factor`` exactly (Decimal arithmetic rounds to 28 digits unless told otherwise)."""
    with localcontext() as ctx:
        ctx.prec = len(value.as_tuple().digits) + len(str(factor)) + 2
        return value * factor


class SizeSyntaxError(InputError):
    """A size that is not written as one (as opposed to one that is written well but out of range)."""


def parse_size(text: str | int) -> int:
    """Parse ``12GB``, ``11.2GiB``, ``512MiB``, ``1e9`` or plain bytes into integer bytes.

    Sizes above :data:`~trainledger.checks.MAX_BYTES` (1 EiB) are refused: no machine has that memory.

    Example:
        >>> parse_size("1.5KiB"), parse_size("2GB")
        (1536, 2000000000)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = Decimal(text), ""
    else:
        m = _SIZE_RE.match(str(text))
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise SizeSyntaxError(f"size {text!r} is not understood; use bytes or a unit: 12GB, 11.2GiB, 512MiB, 1e9")
        value, unit = _decimal(m.group(1), "size", text), m.group(2).lower()
    if value <= 0:
        raise InputError(f"size {text!r} must be positive, e.g. 12GB, 11.2GiB, 512MiB")
    nbytes = _times(value, _SIZE_UNITS[unit])
    if nbytes > MAX_BYTES.value:
        raise InputError(f"size {text!r} is more than {MAX_BYTES.value:,} bytes, the most accepted ({MAX_BYTES.why})")
    if nbytes < 1:
        raise InputError(f"size {text!r} is less than one byte; give at least 1 byte")
    return int(nbytes.to_integral_value())


_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_COUNT_RE = re.compile(rf"^\s*{_NUMBER}\s*([kKmMbBtT]?)\s*$")


def parse_count(text: str | int, *, zero: bool = False) -> int:
    """Parse a positive whole count: ``423``, ``1e9``, ``7B``, ``1.5M`` (exactly: no float rounding); with
    ``zero``, 0 too.

    Example:
        >>> parse_count("1e9"), parse_count("7B"), parse_count("1e40") == 10**40, parse_count("0", zero=True)
        (1000000000, 7000000000, True, 0)
    """
    m = _COUNT_RE.match(str(text))
    if not m:
        raise InputError(f"count {text!r} is not a number; use e.g. 423, 1e9, 7B, 1.5M")
    value = _times(_decimal(m.group(1), "count", text), _COUNT_SUFFIX[m.group(2).lower()])
    if value < 0 or (value == 0 and not zero):
        least = "0 or more" if zero else "positive (above 0)"
        raise InputError(f"count {text!r} must be {least}, e.g. 423, 1e9, 7B")
    if value != value.to_integral_value():
        raise InputError(f"count {text!r} must be a whole number, e.g. 423, 1e9, 7B")
    return int(value)


def format_bytes(nbytes: int | float, *, binary: bool = True) -> str:
    """``1.50 GiB`` (1024-based, default) or ``1.61 GB`` (1000-based)."""
    if binary:
        base, units = 1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    else:
        base, units = 1000, ("B", "kB", "MB", "GB", "TB", "PB", "EB")
    value, unit = float(nbytes), units[0]
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            break
        value /= base
    return f"{int(value)} {unit}" if unit == "B" else f"{value:.2f} {unit}"


# Bytes per element of each stored precision, keyed by torch's name without the ``torch.`` prefix.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}

_DTYPE_ALIASES = {
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
    "binary64": "float64",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "int": "int64",
    "long": "int64",
}


def counted(n: int, noun: str) -> str:
    """``n`` and the noun, plural unless ``n`` is 1 (``counted(1, "region")`` is ``1 region``)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def parse_dtype(text: str) -> str:
    """Canonical dtype name from what users type: ``bf16`` → ``bfloat16``, ``torch.float32`` → ``float32``."""
    name = str(text).strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        accepted = "fp32, bf16, fp16, fp64, fp8 (e4m3/e5m2), int8"
        raise InputError(f"unknown dtype {text!r}; accepted: {accepted}")
    return name


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[parse_dtype(dtype)]


def short_dtype(dtype: str) -> str:
    """The short name people write: ``bfloat16`` → ``bf16``."""
    return {"float64": "fp64", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype)
