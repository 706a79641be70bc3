"""``--device NAME`` and ``--allocator [CONF]``: a device from the table and the caching allocator's model."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rich.text import Text

from trainledger.allocator import AllocatorConfig, ReservedPrediction, predict_reserved
from trainledger.commands.common import argparse_type
from trainledger.devices import Device, lookup
from trainledger.ledger import Ledger
from trainledger.report.terminal import both_units

device_arg = argparse_type(lookup)
"""A device of the table by name (``h100-80gb``); an unknown one is refused with the close names."""
alloc_conf_arg = argparse_type(AllocatorConfig.from_alloc_conf)
"""``PYTORCH_ALLOC_CONF`` syntax (``expandable_segments:True``), parsed into an :class:`AllocatorConfig`."""


def add_device_flags(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--device",
        type=device_arg,
        default=None,
        metavar="NAME",
        help="an accelerator by name (h100-80gb, a100-40gb, a100-80gb, h200, l4, rtx-4090, ...): its usable "
        "memory is the limit, and the caching allocator's model predicts reserved memory",
    )
    p.add_argument(
        "--allocator",
        type=alloc_conf_arg,
        nargs="?",
        const=AllocatorConfig(),
        default=None,
        metavar="PYTORCH_ALLOC_CONF",
        help="replay the step through a model of PyTorch's CUDA caching allocator (predicted reserved peak, "
        "fragmentation); optionally with options, e.g. expandable_segments:True (on with --device)",
    )


@dataclass(frozen=True)
class Target:
    """The device a command's figures are judged against, and whether the allocator model runs."""

    device: Device | None
    allocator: AllocatorConfig | None
    """``None``: the allocator model is off."""

    @classmethod
    def of(cls, args: argparse.Namespace) -> Target:
        device = getattr(args, "device", None)
        config = getattr(args, "allocator", None)
        return cls(device, config if config is not None or device is None else AllocatorConfig())

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.device is None else self.device.usable_bytes

    def predict(self, ledger: Ledger, *, kernel_kind: str) -> ReservedPrediction | None:
        """The allocator model's prediction for ``ledger``, or ``None`` when the model is off."""
        if self.allocator is None:
            return None
        return predict_reserved(
            ledger, kernel_kind=kernel_kind, config=self.allocator, capacity_bytes=self.capacity_bytes
        )


def device_line(device: Device) -> str:
    """What a command assumes of ``--device``: its memory, where the figure comes from, its kernels."""
    return (
        f"device {device.name}: usable {device.usable_bytes:,} bytes ({both_units(device.usable_bytes)}) = total "
        f"{both_units(device.total_bytes)} ({device.total_source}'s figure) less {both_units(device.context_bytes)} "
        f"CUDA context (an estimate); {device.kernel_kind} kernels, bf16 {'yes' if device.bf16 else 'no'}, "
        f"flash SDPA {'yes' if device.flash_attention else 'no'}"
    )


_VERDICTS = {
    "fits": "fits",
    "oom": "would OOM: the allocated bytes alone exceed it",
    "oom-although-allocated-fits": "would OOM although allocated fits (no free block large enough: fragmentation)",
}


def reserved_text(p: ReservedPrediction, device: Device | None) -> Text:
    """The allocator model's prediction, with its evidence and the kernels it replayed."""
    head = (
        f"allocator model (evidence {p.evidence}; the ledger's {p.kernel_kind} kernels replayed as CUDA "
        f"allocations): predicted max reserved {p.max_reserved_bytes:,} bytes ({both_units(p.max_reserved_bytes)}), "
        f"max allocated {p.max_allocated_bytes:,} ({both_units(p.max_allocated_bytes)})"
    )
    peak = (
        f"  at the allocated peak: fragmentation {p.fragmentation_bytes:,} bytes ({100 * p.fragmentation_share:.1f}% "
        f"of reserved), largest free block {both_units(p.largest_free_block_bytes)}, {p.num_segments} segments"
    )
    lines = [head, peak]
    if p.capacity_bytes is not None:
        where = f"{device.name}'s usable {both_units(p.capacity_bytes)}" if device else both_units(p.capacity_bytes)
        verdict = f"  on {where}: {_VERDICTS[p.verdict]}"
        if p.oom_entry is not None:
            at = "before the step" if p.oom_event is None else f"at event {p.oom_event}"
            verdict += f"; the allocation that fails: {p.oom_entry} {at}"
        if p.num_cache_flushes:
            verdict += f"; {p.num_cache_flushes} cache flushes and retries (each one synchronises the device)"
        lines.append(verdict)
    return Text("\n".join(lines))
