"""Write a plan as a Python file that runs it without trainledger (``Plan.export_policy``).

The file is ``_policy_file.py`` (imports only torch) with a header comment that says where the plan came
from, and its two placeholders (``REGIONS``, ``SAVED_OP_NAMES``) filled with the plan's data. ``plan`` is a ``Plan``
(untyped here: ``_plan`` imports this module).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_POLICY_FILE = Path(__file__).with_name("_policy_file.py")  # read as text, not imported
_REGIONS_LINE = "REGIONS: list[tuple[str, str, int | None, int, tuple[str, ...]]] = []  # the plan's regions\n"
_SAVED_LINE = "SAVED_OP_NAMES: frozenset[str] = frozenset()  # the plan's saved ops\n"


def policy_source(plan: Any, *, saved_op_names: frozenset[str], command: str = "") -> str:
    """The text of the policy file for ``plan`` (see :func:`export_policy`)."""
    source = _POLICY_FILE.read_text()
    assert source.count(_REGIONS_LINE) == 1 and source.count(_SAVED_LINE) == 1, "placeholders moved"
    regions = "".join(
        f"    ({r.path!r}, {r.policy!r}, {r.call!r}, {r.num_calls!r}, {tuple(r.restore)!r}),\n" for r in plan.regions
    )
    saved = "".join(f"        {name!r},\n" for name in sorted(saved_op_names))
    source = source.replace(
        _REGIONS_LINE, f"REGIONS: list[tuple[str, str, int | None, int, tuple[str, ...]]] = [\n{regions}]\n"
    )
    source = source.replace(_SAVED_LINE, f"SAVED_OP_NAMES: frozenset[str] = frozenset(\n    {{\n{saved}    }}\n)\n")
    return _header(plan, command) + source


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
    return "".join(f"# {line}\n" for line in lines)


def export_policy(plan: Any, path: str | Path, *, saved_op_names: frozenset[str], command: str = "") -> None:
    """Write ``plan`` to ``path`` as a Python module with ``REGIONS``, ``policy_fn``, ``apply`` and ``remove``."""
    Path(path).write_text(policy_source(plan, saved_op_names=saved_op_names, command=command))
