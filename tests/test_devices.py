"""The device table: lookups, the three memory figures, and what each card supports."""

from __future__ import annotations

import pytest

from trainledger.devices import CUDA_CONTEXT_BYTES_ESTIMATE, DEVICES, device_names, lookup
from trainledger.errors import InputError

MiB = 1 << 20


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("h100", "H100-80GB-SXM"),
        ("H100-80GB", "H100-80GB-SXM"),
        ("h100 pcie", "H100-80GB-PCIe"),
        ("A100_80GB", "A100-80GB"),
        ("a100", "A100-80GB"),
        ("RTX 4090", "RTX-4090"),
        ("v100", "V100-32GB"),
        ("mi300x", "MI300X"),
        (" L40S ", "L40S"),
    ],
)
def test_lookup_by_alias(name, canonical):
    assert lookup(name).name == canonical


def test_unknown_device_names_close_ones():
    with pytest.raises(InputError) as exc:
        lookup("a100-81gb")
    message = str(exc.value)
    assert "'a100-81gb'" in message and "\n" not in message
    assert "close names: a100-80gb" in message


def test_unknown_device_like_none_lists_every_device():
    with pytest.raises(InputError) as exc:
        lookup("zzzz")
    message = str(exc.value)
    for name in ("h100-80gb-sxm", "a100-40gb", "rtx-3090", "l4", "a10g"):
        assert name in message


def test_every_name_is_unique_and_listed():
    canonical = [d.name.lower() for d in DEVICES]
    assert len(set(canonical)) == len(DEVICES)
    assert set(canonical) <= set(device_names())
    assert sum(len(d.aliases) for d in DEVICES) >= len(DEVICES)


def test_h100_memory_figures():
    h100 = lookup("h100")
    assert h100.nominal_bytes == 80 * 10**9
    assert h100.driver_total_bytes == 85_520_809_984 == 81559 * MiB  # nvidia-smi's 81,559 MiB = 79.65 GiB
    assert h100.torch_total_bytes == 81089 * MiB  # totalGlobalMem: 470 MiB below the driver's total
    assert (h100.total_bytes, h100.total_source) == (81089 * MiB, "torch")
    assert h100.usable_bytes == 81089 * MiB - CUDA_CONTEXT_BYTES_ESTIMATE


def test_figures_are_ordered_where_known():
    for d in DEVICES:
        assert d.driver_total_bytes is None or d.driver_total_bytes > d.nominal_bytes, d.name
        if d.torch_total_bytes is not None and d.driver_total_bytes is not None:
            assert d.torch_total_bytes <= d.driver_total_bytes, d.name
        assert 0 < d.usable_bytes < d.total_bytes
        assert d.source.startswith("https://")


def test_total_falls_back_to_the_driver_then_the_nominal():
    assert lookup("a100-80gb").total_source == "driver" and lookup("a100-80gb").total_bytes == 81920 * MiB
    pcie = lookup("h100-pcie")
    assert (pcie.total_source, pcie.total_bytes) == ("nominal", 80 * 10**9)


@pytest.mark.parametrize(
    ("name", "capability", "bf16", "flash"),
    [
        ("v100-16gb", (7, 0), False, False),
        ("a100-40gb", (8, 0), True, True),
        ("a10g", (8, 6), True, True),
        ("l4", (8, 9), True, True),
        ("h200", (9, 0), True, True),
        ("mi300x", None, True, True),
    ],
)
def test_capabilities(name, capability, bf16, flash):
    d = lookup(name)
    assert (d.compute_capability, d.bf16, d.flash_attention) == (capability, bf16, flash)


def test_context_estimate_is_within_the_stated_range():
    assert 300 * MiB <= CUDA_CONTEXT_BYTES_ESTIMATE <= 600 * MiB
