"""``AllocatorConfig``: the ``PYTORCH_ALLOC_CONF`` options that change what the allocator reserves."""

from __future__ import annotations

from dataclasses import dataclass

from trainledger.allocator._sizes import LARGE_BUFFER, MIN_LARGE_ALLOC, ROUNDUP_POWER2_INTERVALS, MiB, roundup_interval
from trainledger.errors import InputError

# Keys of PYTORCH_ALLOC_CONF (c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.h in 2.13.0) that do
# not change which blocks and segments the native allocator creates: parsed and ignored.
_NEUTRAL_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "pinned_free_catch_all",
        "graph_capture_record_stream_reuse",
        "throw_on_cudamalloc_oom",
    }
)
_MODELLED_KEYS = (
    "expandable_segments",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "large_segment_size_mb",
    "roundup_power2_divisions",
    "backend",
)


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """The allocator options this model follows (``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``).

    Defaults are PyTorch's. ``from_alloc_conf`` reads the environment-variable syntax.

    Example:
        >>> cfg = AllocatorConfig.from_alloc_conf("expandable_segments:True,max_split_size_mb:128")
        >>> cfg.expandable_segments, cfg.max_split_size_bytes // 2**20, cfg.non_split_rounding_bytes // 2**20
        (True, 128, 20)
    """

    max_split_size_bytes: int | None = None
    """``max_split_size_mb``: blocks this large or larger are never split; a smaller request never takes
    one, and a request at least this large takes a cached one only if it is less than
    ``non_split_rounding_bytes`` too big. ``None``: unlimited (PyTorch's default)."""
    max_non_split_rounding_bytes: int | None = None
    """``max_non_split_rounding_mb``: the slack an oversize request accepts in a cached oversize block.
    ``None``: ``large_segment_size_bytes`` (PyTorch's default, 20 MiB)."""
    large_segment_size_bytes: int = LARGE_BUFFER
    """``large_segment_size_mb``: the segment shared by large requests under 10 MiB, and the page of the
    large pool's expandable segments (20 MiB)."""
    roundup_power2_divisions: int | tuple[int, ...] = 0
    """``roundup_power2_divisions``: one value for every size, or 16 values, one per power-of-two interval
    from 1 MiB (index 0, which also covers smaller sizes) to 32 GiB and above (index 15). A request in an
    interval with ``d > 1`` divisions is rounded up to the next of ``d`` equal steps. 0 or 1: off."""
    expandable_segments: bool = False
    """``expandable_segments``: one segment per stream and pool that grows by mapping pages (2 MiB for the
    small pool, ``large_segment_size_bytes`` for the large pool) instead of one ``cudaMalloc`` per segment."""

    def __post_init__(self) -> None:
        seg = self.large_segment_size_bytes
        if seg <= MIN_LARGE_ALLOC or seg % MiB:
            raise InputError(
                f"large_segment_size {seg} bytes must be a whole number of MiB above 10 MiB (PyTorch's limit)"
            )
        for name, value in (
            ("max_split_size", self.max_split_size_bytes),
            ("max_non_split_rounding", self.max_non_split_rounding_bytes),
        ):
            if value is not None and (value < seg or value % MiB):
                raise InputError(
                    f"{name} {value} bytes must be a whole number of MiB and at least large_segment_size "
                    f"({seg // MiB} MiB), as PyTorch requires"
                )
        table = self.roundup_power2_divisions
        values = (table,) if isinstance(table, int) else table
        if not isinstance(table, int) and len(table) != ROUNDUP_POWER2_INTERVALS:
            raise InputError(
                f"roundup_power2_divisions needs one value or {ROUNDUP_POWER2_INTERVALS} (one per power-of-two "
                f"interval from 1 MiB); got {len(table)}"
            )
        for v in values:
            if v < 0 or v & (v - 1):
                raise InputError(f"roundup_power2_divisions value {v} must be 0 or a power of two")

    @property
    def non_split_rounding_bytes(self) -> int:
        """The slack an oversize request accepts (``max_non_split_rounding_mb``, default the large segment)."""
        if self.max_non_split_rounding_bytes is None:
            return self.large_segment_size_bytes
        return self.max_non_split_rounding_bytes

    def roundup_divisions_for(self, nbytes: int) -> int:
        """The ``roundup_power2_divisions`` value that applies to a request of ``nbytes``."""
        table = self.roundup_power2_divisions
        return table if isinstance(table, int) else table[roundup_interval(nbytes)]

    @classmethod
    def from_alloc_conf(cls, text: str) -> AllocatorConfig:
        """Read ``PYTORCH_ALLOC_CONF`` syntax: ``key:value`` pairs separated by commas.

        Options that do not change reserved memory (``pinned_*``, ``release_lock_on_cudamalloc``…) are
        accepted and ignored; ``garbage_collection_threshold`` and ``per_process_memory_fraction`` are
        refused with the way to express them here; unknown keys are refused.

        Example:
            >>> cfg = AllocatorConfig.from_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:4]")
            >>> cfg.roundup_divisions_for(300 * 2**20), cfg.roundup_divisions_for(600 * 2**20)
            (1, 2)
            >>> cfg.roundup_divisions_for(2**30), cfg.roundup_divisions_for(2**20)
            (4, 1)
        """
        fields: dict[str, object] = {}
        for item in _split_top_level(text):
            key, sep, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise InputError(f"allocator option {item!r} is not key:value (e.g. expandable_segments:True)")
            if key == "expandable_segments":
                fields["expandable_segments"] = _parse_bool(key, value)
            elif key == "max_split_size_mb":
                fields["max_split_size_bytes"] = _parse_mb(key, value)
            elif key == "max_non_split_rounding_mb":
                fields["max_non_split_rounding_bytes"] = _parse_mb(key, value)
            elif key == "large_segment_size_mb":
                fields["large_segment_size_bytes"] = _parse_mb(key, value)
            elif key == "roundup_power2_divisions":
                fields["roundup_power2_divisions"] = _parse_divisions(value)
            elif key == "backend":
                if value != "native":
                    raise InputError(f"backend:{value} is not modelled; only the native caching allocator is")
            elif key == "garbage_collection_threshold":
                raise InputError(
                    "garbage_collection_threshold is not modelled (it acts only under a per-process memory "
                    "fraction); remove it to predict without it"
                )
            elif key == "per_process_memory_fraction":
                raise InputError(
                    "per_process_memory_fraction is not an allocator setting here; pass the capacity it "
                    "leaves (fraction × device total) as capacity_bytes instead"
                )
            elif key not in _NEUTRAL_KEYS:
                raise InputError(
                    f"unknown allocator option {key!r}; modelled: {', '.join(_MODELLED_KEYS)}; "
                    f"ignored: {', '.join(sorted(_NEUTRAL_KEYS))}"
                )
        return cls(**fields)  # type: ignore[arg-type]


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside ``[...]``: ``a:1,b:[64:8,>:1]`` → ``a:1``, ``b:[64:8,>:1]``."""
    items, depth, current = [], 0, []
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _parse_bool(key: str, value: str) -> bool:
    if value not in ("True", "False"):
        raise InputError(f"{key}:{value} must be True or False")
    return value == "True"


def _parse_mb(key: str, value: str) -> int:
    if not value.isdigit():
        raise InputError(f"{key}:{value} must be a whole number of MiB")
    return int(value) * MiB


def _parse_divisions(value: str) -> int | tuple[int, ...]:
    """``4`` (every size) or ``[64:8,128:2,>:1]`` (boundaries in MiB), as ``parseRoundUpPower2Divisions``."""
    if not value.startswith("["):
        if not value.isdigit():
            raise InputError(f"roundup_power2_divisions:{value} must be a number or a [size_mb:divisions,...] list")
        return int(value)
    if not value.endswith("]"):
        raise InputError(f"roundup_power2_divisions:{value} lacks its closing ']'")
    table = [0] * ROUNDUP_POWER2_INTERVALS
    first, last_index = True, 0
    for pair in value[1:-1].split(","):
        boundary, _, divisions = (p.strip() for p in pair.partition(":"))
        if not divisions.isdigit():
            raise InputError(f"roundup_power2_divisions entry {pair!r} must be size_mb:divisions")
        d = int(divisions)
        if boundary == ">":  # every interval above the last one named
            table[last_index + 1 :] = [d] * (ROUNDUP_POWER2_INTERVALS - last_index - 1)
            continue
        if not boundary.isdigit() or int(boundary) & (int(boundary) - 1) or int(boundary) == 0:
            raise InputError(f"roundup_power2_divisions boundary {boundary!r} must be a power of two (MiB)")
        index = min(int(boundary).bit_length() - 1, ROUNDUP_POWER2_INTERVALS - 1)
        if first:  # the first value also covers every interval below it
            table[:index] = [d] * index
            first = False
        table[index] = d
        last_index = index
    return tuple(table)
