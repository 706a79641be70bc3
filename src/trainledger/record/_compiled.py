"""Compiled regions of a recorded model: which modules ``torch.compile`` wraps, and what a traced step of them is.

While a dispatch mode that traces is on the stack, dynamo does not run compiled code: it skips every frame
("non-infra torch dispatch mode present") and the module runs eagerly, op by op. So a traced step of a
compiled model is the eager step — every op is seen, and the ledger is exact for it — but not the step the
compiled graph runs: its kernels (fused, with their own buffers) and, with inductor, its random numbers
(a compiled dropout draws other numbers) are not the compiled ones. Steps outside ``record(steps=...)`` run
untraced, compiled. Letting dynamo run under the tracer (``ignore_compile_internals``) is no way out: it
then traces the tracer's own module hooks into the graph and breaks it there, which changes the compiled
graph too.

Inside the tracer's dispatch handler the mode is off the stack, so dynamo, still watching frames below the
compiled module's call, would compile the tracer's own code: :func:`dynamo_skipped` keeps it out.
"""

from __future__ import annotations

import functools
import gc
import sys
from typing import Any

from torch import nn


def compiled_modules(model: nn.Module) -> list[str]:
    """Paths of the modules of ``model`` that run compiled: ``module.compile()``-d ones, and those an
    ``OptimizedModule`` (``torch.compile(module)``) wraps, found among Python's objects ("(root)" for
    ``model`` itself)."""
    paths = {id(m): n or "(root)" for n, m in model.named_modules()}
    found = {paths[id(m)] for _, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
    found |= {paths[id(m)] for m in model.modules() if id(getattr(m, "_orig_mod", None)) in paths}
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is None:  # nothing was compiled in this process (and importing dynamo costs seconds)
        return sorted(found)
    for obj in gc.get_objects():
        if type(obj) is dynamo.OptimizedModule and id(obj._orig_mod) in paths:
            found.add(paths[id(obj._orig_mod)])
    return sorted(found)


def compiled_note(paths: list[str]) -> tuple[str, ...]:
    """The note a traced step of a model with compiled modules carries (none without)."""
    if not paths:
        return ()
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return (
        f"compiled modules ({shown}) ran eagerly while this step was traced (torch.compile does not run under a "
        "tracing dispatch mode): the ledger is the eager step's, exact for it; the compiled step's fused kernels "
        "and, with inductor, its random numbers differ. Trace only the steps you need (record(steps=...)): the "
        "others run compiled",
    )


@functools.cache
def dynamo_skipped(tracer_class: type) -> type:
    """A subclass of ``tracer_class`` whose ``__torch_dispatch__`` (and all it calls) dynamo never compiles."""
    import torch._dynamo

    class DynamoSkipped(tracer_class):  # type: ignore[misc, valid-type]
        @torch._dynamo.disable(recursive=True)
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            return super().__torch_dispatch__(func, types, args, kwargs)

    DynamoSkipped.__name__ = DynamoSkipped.__qualname__ = f"DynamoSkipped{tracer_class.__name__}"
    return DynamoSkipped
