"""The optional integrations' modules import their framework at the top: without the extra installed, their
doctests are not collected (their tests skip and say why)."""

from __future__ import annotations

import importlib.util

collect_ignore = [
    path
    for path, module in (
        ("src/trainledger/integrations/hf.py", "transformers"),
        ("src/trainledger/integrations/lightning.py", "lightning"),
    )
    if importlib.util.find_spec(module) is None
]
