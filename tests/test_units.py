from __future__ import annotations

import pytest

from trainledger.units import format_bytes, parse_count, parse_dtype, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("12GB", 12 * 10**9), ("11.2GiB", round(11.2 * 2**30)), ("512MiB", 512 * 2**20), ("1e9", 10**9), ("4096", 4096)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12XB", "-1GB", "0", "abc", "nan"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_parse_count():
    assert parse_count("1e9") == 10**9 and parse_count("7B") == 7 * 10**9 and parse_count("423") == 423
    assert parse_count("1e40") == 10**40  # exactly: no float rounding noise
    assert parse_count(str(10**28 + 1)) == 10**28 + 1
    assert parse_count("1.000000000000000000000000000001e30") == 10**30 + 1
    for bad in ["0", "-5", "1.5", "x"]:
        with pytest.raises(ValueError, match="count"):
            parse_count(bad)
    with pytest.raises(ValueError, match="count '-1' must be positive"):  # a number, just not a count
        parse_count("-1")


def test_parse_size_refuses_sizes_beyond_any_machine():
    assert parse_size("1e18") == 10**18 and parse_size(2**60) == 2**60
    for text in ["1e19", "1e30", "1e999"]:
        with pytest.raises(ValueError, match="size"):
            parse_size(text)


def test_parse_dtype():
    assert parse_dtype("bf16") == "bfloat16" and parse_dtype("torch.float32") == "float32"
    with pytest.raises(ValueError, match="unknown dtype 'fp12'"):
        parse_dtype("fp12")


def test_format_bytes_says_which_unit():
    assert format_bytes(12 * 10**9, binary=False) == "12.00 GB"
    assert format_bytes(2**30) == "1.00 GiB"
    assert format_bytes(512) == "512 B"
