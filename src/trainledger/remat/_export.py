"""Write a plan as a Python file that runs it without trainledger (``Plan.export_policy``).

The file is ``_policy_file.py`` (imports only torch) with a header comment that says where the plan came
from, and its placeholders (``REGIONS``, ``POLICIES``, ``STRIDED_OPS``) filled with the plan's data. ``plan``
is a ``Plan`` (untyped here: ``_plan`` imports this module).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainledger.errors import InputError

_POLICY_FILE = Path(__file__).with_name("_policy_file.py")  # read as text, not imported
_REGIONS_LINE = "REGIONS: list[tuple[str, str, int | None, int, tuple[str, ...]]] = []  # the plan's regions\n"
_POLICIES_LINE = "POLICIES: dict[str, tuple[frozenset[str], int]] = {}  # the plan's policies\n"
_STRIDED_LINE = "STRIDED_OPS: frozenset[str] = frozenset()  # matrix products\n"


def policy_source(plan: Any, *, policies: dict[str, Any], strided_ops: frozenset[str], command: str = "") -> str:
    """The text of the policy file for ``plan`` (see :func:`export_policy`); ``policies``: the op-level
    policies by name (:data:`~trainledger.remat.OP_POLICIES`), of which the plan's are written;
    ``strided_ops``: the ops a matmul stride counts."""
    source = _POLICY_FILE.read_text()
    for line in (_REGIONS_LINE, _POLICIES_LINE, _STRIDED_LINE):
        assert source.count(line) == 1, f"placeholder moved: {line!r}"
    regions = "".join(
        f"    ({r.path!r}, {r.policy!r}, {r.call!r}, {r.num_calls!r}, {tuple(r.restore)!r}),\n" for r in plan.regions
    )
    used = sorted({r.policy for r in plan.regions if r.policy != "full"})
    entries = "".join(
        f"    # {policies[name].description}\n"
        f"    {name!r}: (\n        {_set_literal(policies[name].saved_ops, 8)},\n"
        f"        {policies[name].matmul_stride},\n    ),\n"
        for name in used
    )
    source = source.replace(
        _REGIONS_LINE, f"REGIONS: list[tuple[str, str, int | None, int, tuple[str, ...]]] = [\n{regions}]\n"
    )
    source = source.replace(_POLICIES_LINE, f"POLICIES: dict[str, tuple[frozenset[str], int]] = {{\n{entries}}}\n")
    source = source.replace(_STRIDED_LINE, f"STRIDED_OPS: frozenset[str] = {_set_literal(strided_ops, 0)}\n")
    return _header(plan, command) + source


def _set_literal(names: frozenset[str], indent: int) -> str:
    """``frozenset({...})`` with one name a line, its first line at ``indent`` spaces."""
    pad = " " * indent
    items = "".join(f"{pad}        {n!r},\n" for n in sorted(names))
    return f"frozenset(\n{pad}    {{\n{items}{pad}    }}\n{pad})"


def _header(plan: Any, command: str) -> str:
    def size(nbytes: int | None) -> str:
        return "not saved" if nbytes is None else f"{nbytes:,} bytes ({nbytes / 2**20:,.1f} MiB)"

    lines = [
        "Activation checkpointing plan exported by trainledger; needs only torch.",
        f"model: {plan.model or '(not named)'}; structure fingerprint {plan.fingerprint[:16]}",
        f"budget: {size(plan.budget_bytes)}; plain step's traced peak: {size(plan.plain_peak_bytes)}",
        f"predicted peak with the plan: {size(plan.predicted_peak_bytes)}",
        f"made by: {command or '(the library: Plan.export_policy)'}",
        f"regions: {len(plan.regions)} ({', '.join(r.label for r in plan.regions) or 'none'})",
    ]
    if getattr(plan, "kernel_kind", "cpu") == "cuda":  # the peaks above assume CUDA's kernels on that card
        lines.insert(4, f"kernels: cuda as on {plan.cuda_device} (predicted on fake tensors, not measured)")
    return "".join(f"# {line}\n" for line in lines)


def export_policy(
    plan: Any, path: str | Path, *, policies: dict[str, Any], strided_ops: frozenset[str], command: str = ""
) -> None:
    """Write ``plan`` to ``path`` as a Python module with ``REGIONS``, ``POLICIES``, ``policy_fn``, ``apply``
    and ``remove``."""
    source = policy_source(plan, policies=policies, strided_ops=strided_ops, command=command)
    try:
        Path(path).write_text(source)
    except OSError as exc:
        raise InputError(f"cannot write the policy to {str(path)!r}: {exc.strerror or type(exc).__name__}") from None
