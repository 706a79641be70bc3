"""Which unit (FSDP wrap, DeepSpeed stage-3 module) a parameter or an op belongs to. Pure, no torch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from trainledger.ledger import REFERENCE_SCOPE, ROOT_SCOPE


def infer_units(param_names: Iterable[str]) -> tuple[str, ...]:
    """The repeated blocks of a model, from its parameter names: ``blocks.0``, ``blocks.1``… — the
    first dotted prefix followed by at least two distinct integers, each naming a module (``plist.0`` of an
    ``nn.ParameterList`` is a parameter, not a unit). These become the FSDP units (one per transformer
    block, the root taking the rest), as ``trainledger shard --run`` wraps them. A model that is itself an
    ``nn.Sequential`` (or list) of modules has its children as units, as when it is held inside another.

    Example:
        >>> infer_units(["wte.weight", "h.0.attn.w", "h.0.mlp.w", "h.1.attn.w", "ln_f.weight"])
        ('h.0', 'h.1')
        >>> infer_units(["plist.0", "plist.1", "head.weight"])
        ()
        >>> infer_units(["0.weight", "0.bias", "2.weight"])
        ('0', '2')
    """
    found: dict[str, list[int]] = {}
    order: list[str] = []
    for name in param_names:
        parts = name.split(".")
        for i in range(len(parts) - 1):  # the last part is the parameter's own name
            if parts[i].isdigit():
                prefix = ".".join(parts[:i])
                if prefix not in found:
                    found[prefix] = []
                    order.append(prefix)
                if int(parts[i]) not in found[prefix]:
                    found[prefix].append(int(parts[i]))
                break
    for prefix in order:  # the first (outermost) repeated container wins
        if len(found[prefix]) >= 2:
            return tuple(f"{prefix}.{i}" if prefix else str(i) for i in found[prefix])
    return ()


def unit_of(name: str, units: Sequence[str]) -> str:
    """The unit holding a parameter or module path: the longest unit prefix, else the root ``""``."""
    best = ""
    for u in units:
        if (name == u or name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def in_model(module: str, *, reference: bool = False) -> bool:
    """Whether an event's module (as the tracer names it) is part of the model: ``(root)`` or a submodule
    path. ``""`` is outside every module (a ``loss_fn``'s forward ops, the seed of backward), ``(loss)``
    the backward of a loss computed outside the model, and with ``reference`` (the step has a frozen
    reference model) ``reference…`` that model's modules, which the loss calls.

    Example:
        >>> [in_model(m) for m in ("(root)", "blocks.0.attn", "", "(loss)")]
        [True, True, False, False]
        >>> in_model("reference.0", reference=True)
        False
    """
    if reference and (module == REFERENCE_SCOPE or module.startswith(REFERENCE_SCOPE + ".")):
        return False
    return module == ROOT_SCOPE or (module != "" and not module.startswith("("))


def fsdp_cannot_shard(params: Sequence[tuple[Sequence[str], tuple[int, ...]]], units: Sequence[str]) -> list[str]:
    """What FSDP2 (``fully_shard`` on each unit, then on the root) refuses or fails on among the parameters, each
    given as the names it goes by and its shape: a 0-dim parameter (refused), and one used under more than one
    unit (or under a unit and the root's own modules), which is a shard of the unit that took it wherever another
    uses it. Each problem is a clause to follow "FSDP (stages 2 and 3) ".

    Example:
        >>> fsdp_cannot_shard([(["h.0.w"], (4,)), (["h.0.p.w", "h.1.p.w"], (4, 4))], ["h.0", "h.1"])[0][:73]
        'shards each parameter with one unit, and h.0.p.w is shared by h.0 and h.1'
    """
    problems = []
    scalars = [names[0] for names, shape in params if not shape]
    if scalars:
        listed = ", ".join(scalars[:4]) + (", ..." if len(scalars) > 4 else "")
        problems.append(
            f"cannot shard a 0-dim parameter, and this model has {len(scalars)} ({listed}): make each a 1-element "
            "1-D tensor (nn.Parameter(torch.tensor([x])))"
        )
    shared: dict[tuple[str, ...], list[Sequence[str]]] = {}  # the units sharing -> the parameters they share
    for names, _shape in params:
        holders = tuple(dict.fromkeys(unit_of(n, units) or "the root" for n in names))
        if len(holders) > 1:
            shared.setdefault(holders, []).append(names)
    for holders, shared_names in shared.items():
        first = shared_names[0]
        what = f"{first[0]} is" if len(shared_names) == 1 else f"{first[0]} and {len(shared_names) - 1} more are"
        problems.append(
            f"shards each parameter with one unit, and {what} shared by {' and '.join(holders)} (as "
            f"{', '.join(first)}): the others would find them sharded; hold a shared module outside the repeated "
            "blocks (in the model's root, used from its forward)"
        )
    return problems
