"""The analytic ledger: parameters, optimizer state, gradients, activations and workspace of one step,
laid on a coarse event clock so that the peak is taken at one instant (no torch).

Events, in order: the reference model's forward (DPO only), the embeddings, each decoder layer, the
head, the loss; in backward the loss, the logits' cast, the head, each layer in reverse, the embeddings;
then the optimizer and ``zero_grad``. Activations live from their layer's forward event to its backward
event; gradients from their module's backward event to ``zero_grad``; workspace for one event.

Workspace (temporaries that are not saved) is modelled at the instants where it matters: the logits and
their fp32 copy around the loss, the gradient of the logits, a layer's recomputation under full
rematerialization, the largest transient of a layer's forward and backward (its widest intermediate and
the gradient of the residual stream), and the optimizer's temporaries (AdamW's ``sqrt``/``div`` pair per
tensor on CPU; one state-sized list of temporaries with ``foreach`` on CUDA). Not modelled: allocator
rounding and fragmentation, communication buffers of tensor/pipeline parallelism, framework objects.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from trainledger.analytic._activations import (
    Saved,
    embedding_saved,
    head_saved,
    layer_saved,
    lora_targets,
    loss_saved,
)
from trainledger.analytic._arch import ArchSpec
from trainledger.analytic._params import ParamTensor, param_tensors
from trainledger.analytic._setup import Setup, setup_to_dict
from trainledger.declared import CPU_RNG_STATE_BYTES, RNG_STATE_ROLE
from trainledger.devices import cublas_workspace_bytes
from trainledger.ledger import Category, Entry, Event, Evidence, Ledger
from trainledger.units import DTYPE_BYTES

EXCLUDED = (
    "analytic estimate (a closed-form model of the step, not a trace): excluded are allocator rounding and "
    "fragmentation, tensor/pipeline-parallel communication buffers, kernels' internal scratch memory, and "
    "framework objects"
)


def _div(numel: int, parts: int) -> int:
    return -(-numel // parts)


_Trainable = tuple[str, int, str, int | None, tuple[int, ...]]
"""A trainable array: name, elements on this rank, module, decoder layer (``None`` outside the layers), shape."""


@dataclass
class _Clock:
    """The events of the step, by what happens at them."""

    fwd: dict[str, int]
    bwd: dict[str, int]
    casts: dict[str, int] = field(default_factory=dict)
    """Each trainable array's cast of its gradient to the master dtype."""
    opt: int = 0
    zero: int = 0


class _Builder:
    def __init__(self, spec: ArchSpec, setup: Setup, stage: int) -> None:
        self.spec, self.setup, self.stage = spec, setup, stage
        self.events: list[Event] = []
        self.entries: list[Entry] = []
        self.a = setup.weight_dtype
        p = setup.pipeline_parallel
        L = spec.num_layers
        per = _div(L, p)
        self.layers = list(range(stage * per, min(L, (stage + 1) * per)))
        self.first = stage == 0
        self.last = stage == p - 1
        self.in_flight = p - stage  # 1F1B: stage s holds p - s micro-batches' activations
        self.rows = setup.micro_batch * (2 if setup.reference else 1)
        self.t = setup.tensor_parallel

    # --- helpers ---

    def event(self, phase: str, op: str, module: str) -> int:
        self.events.append(Event(len(self.events), phase, op, module))
        return len(self.events) - 1

    def add(self, name: str, category: Category, role: str, dtype: str, numel: int, **kw: object) -> None:
        if numel <= 0:
            return
        self.entries.append(
            Entry(
                name=name,
                category=category,
                role=role,
                dtype=dtype,
                numel=numel,
                nbytes=numel * DTYPE_BYTES[dtype],
                device=self.setup.device,
                owner=str(kw.pop("owner", name)),
                evidence=Evidence.ANALYTIC,
                **kw,  # type: ignore[arg-type]
            )
        )

    def tp_numel(self, s: Saved) -> int:
        if self.t > 1 and (s.tp_split or self.setup.sequence_parallel):
            return _div(s.numel, self.t)
        return s.numel

    def saved(self, pieces: Iterable[Saved], alloc: int, free: int, owner: str, extra: int = 0) -> None:
        for s in pieces:
            n = self.tp_numel(s)
            self.add(s.name, Category.ACTIVATIONS, "saved", s.dtype, n, owner=owner, alloc_event=alloc, free_event=free)
            for k in range(extra):  # earlier micro-batches still in flight (1F1B), held across the step
                self.add(f"{s.name}@mb{k + 1}", Category.ACTIVATIONS, "saved", s.dtype, n, owner=owner)

    def work(self, name: str, dtype: str, numel: int, at: int, until: int | None = None, owner: str = "") -> None:
        self.add(
            name,
            Category.WORKSPACE,
            "temporary",
            dtype,
            numel,
            owner=owner or name,
            alloc_event=at,
            free_event=(at + 1) if until is None else until,
        )

    # --- parameters ---

    def params(self) -> list[ParamTensor]:
        keep = []
        for p in param_tensors(self.spec):
            if p.layer is not None:
                if p.layer in self.layers:
                    keep.append(p)
            elif self._owns_nonlayer(p.name):
                keep.append(p)
        return keep

    def _owns_nonlayer(self, name: str) -> bool:
        embed = _is_token_embedding(name) or "wpe" in name
        if embed:  # stage 0; a tied head also keeps a copy on the last stage (Megatron does the same)
            return self.first or (self.last and self.spec.tied and "wpe" not in name)
        return self.last  # final norm and head

    def build(self) -> Ledger:
        spec, setup = self.spec, self.setup
        t = self.t
        params = self.params()
        targets = lora_targets(setup, spec) if setup.lora_rank else ()
        trainable: list[_Trainable] = []
        for p in params:
            n = _div(p.numel, t) if p.tp_split and t > 1 else p.numel
            module = _module_of(p.name)
            if setup.lora_rank:
                self.add(p.name, Category.FROZEN, "param", self.a, n, shape=p.shape)
                if p.lora_target in targets and p.name.endswith(".weight"):
                    d_in, d_out = p.lora_dims
                    base = p.name.removesuffix(".weight")
                    r = setup.lora_rank
                    for nm, numel, shape in (
                        (f"{base}.lora_A", r * d_in, (r, d_in)),
                        (f"{base}.lora_B", d_out * r, (d_out, r)),
                    ):
                        self.add(nm, Category.WEIGHTS, "param", self.a, numel, shape=shape)
                        trainable.append((nm, numel, module, p.layer, shape))
            else:
                self.add(p.name, Category.WEIGHTS, "param", self.a, n, shape=p.shape)
                trainable.append((p.name, n, module, p.layer, p.shape))
        if setup.reference:
            for p in params:
                n = _div(p.numel, t) if p.tp_split and t > 1 else p.numel
                self.add(f"reference.{p.name}", Category.FROZEN, "reference", self.a, n, shape=p.shape)
        for name, n, _module, _layer, shape in trainable:
            if setup.master_dtype:
                self.add(f"optimizer.{name}.master", Category.OPTIMIZER, "master", setup.master_dtype, n, shape=shape)
            for role in setup.optimizer_roles:
                self.add(f"optimizer.{name}.{role}", Category.OPTIMIZER, role, setup.moment_dtype, n, shape=shape)
            if setup.has_step_counter:
                self.add(f"optimizer.{name}.step", Category.OPTIMIZER, "step", "float32", 1)
        if spec.rotary_dim and (self.first or self.last):  # rotary inverse frequencies and their original copy
            for name in ("inv_freq", "original_inv_freq"):
                self.add(f"rotary_emb.{name}", Category.OTHER, "buffer", "float32", spec.rotary_dim // 2)
        # the batch: token ids (the labels are the same tensor); DPO: chosen and rejected
        N = self.rows * setup.seq_len
        self.add("batch.input_ids", Category.INPUTS, "batch", "int64", N)
        if setup.device == "cuda":  # kept for the life of the process once the first matmul ran
            workspace = cublas_workspace_bytes(setup.card, os.environ.get("CUBLAS_WORKSPACE_CONFIG") or None)
            self.add("cuda.cublas_workspace", Category.WORKSPACE, "cublas_workspace", "uint8", workspace)
        self._clock(trainable)
        return Ledger(tuple(self.entries), tuple(self.events), evidence=Evidence.ANALYTIC, device=setup.device)

    # --- the clock ---

    def _clock(self, trainable: list[_Trainable]) -> None:
        """Lay the step on the event clock, then place every array that lives on it (in this order, which
        is the order of the ledger's entries)."""
        clock = _Clock(fwd=self._forward_events(), bwd=self._backward_events())
        clock.casts, clock.opt, clock.zero = self._optimizer_events(trainable)
        self._activations(clock)
        if self.last:
            self._loss_workspace(clock)
        self._layer_workspace(clock)
        self._gradients(clock, trainable)
        self._optimizer_temporaries(clock.opt, trainable)

    def _forward_events(self) -> dict[str, int]:
        """The reference's forward (DPO), the embeddings, each layer's two blocks, the head and the loss."""
        spec, setup = self.spec, self.setup
        fwd: dict[str, int] = {}
        if setup.reference and self.last:
            e = self.event("forward", "reference", "reference")
            # under no_grad nothing is saved; the reference's logits, their fp32 copy and log-softmax at once
            nv = _div(self.rows * setup.seq_len * spec.vocab_size, self.t)
            self.work("reference.logits", self.a, nv, e)
            self.work("reference.logits_fp32", "float32", nv, e)
            self.work("reference.log_softmax", "float32", nv, e)
        if self.first:
            fwd["embed"] = self.event("forward", "embedding", _embed_module(spec))
        for i in self.layers:
            lm = _layer_module(spec, i)
            fwd[f"attn{i}"] = self.event("forward", "attention_block", f"{lm}.{_ATTN}")
            fwd[f"mlp{i}"] = self.event("forward", "mlp_block", f"{lm}.{_MLP}")
        if self.last:
            fwd["head"] = self.event("forward", "lm_head", "lm_head")
            fwd["loss"] = self.event("forward", "cross_entropy", "loss")
        return fwd

    def _backward_events(self) -> dict[str, int]:
        """The loss, the logits' cast and the head; each layer in reverse, its output projections first."""
        bwd: dict[str, int] = {}
        if self.last:
            bwd["loss"] = self.event("backward", "log_softmax_backward", "loss")
            bwd["cast"] = self.event("backward", "logits_cast_backward", "lm_head")
            bwd["head"] = self.event("backward", "lm_head_backward", "lm_head")
        for i in reversed(self.layers):
            lm = _layer_module(self.spec, i)
            # each block's output projection first (its weight gradient, its saved input released), then the rest
            bwd[f"mlp_out{i}"] = self.event("backward", "mlp_output_backward", f"{lm}.{_MLP}")
            bwd[f"mlp_act{i}"] = self.event("backward", "mlp_activation_backward", f"{lm}.{_MLP}")
            bwd[f"mlp{i}"] = self.event("backward", "mlp_input_backward", f"{lm}.{_MLP}")
            bwd[f"attn_out{i}"] = self.event("backward", "attention_output_backward", f"{lm}.{_ATTN}")
            bwd[f"attn{i}"] = self.event("backward", "attention_block_backward", f"{lm}.{_ATTN}")
        if self.first:
            bwd["embed"] = self.event("backward", "embedding_backward", _embed_module(self.spec))
        return bwd

    def _optimizer_events(self, trainable: list[_Trainable]) -> tuple[dict[str, int], int, int]:
        """The gradients' casts to the master dtype, the optimizer's step and ``zero_grad``."""
        # the master-weights optimizer casts each gradient to fp32 in turn (one event per tensor, so the
        # sharding transform sees each copy produced and bucketed on its own), then steps
        casts: dict[str, int] = {}
        if self.setup.master_dtype:
            for name, _n, module, _layer, _shape in trainable:
                casts[name] = self.event("optimizer", "gradient_to_master", module)
        opt = self.event("optimizer", "step", "")
        zero = self.event("zero_grad", "zero_grad", "")
        return casts, opt, zero

    def _activations(self, clock: _Clock) -> None:
        """Saved tensors, from their block's forward to the backward event that releases them."""
        spec, setup, fwd, bwd = self.spec, self.setup, clock.fwd, clock.bwd
        extra = self.in_flight - 1
        if self.first:
            first = f"attn{self.layers[0]}" if self.layers else "embed"
            pieces = embedding_saved(spec, setup, self.rows)
            if setup.remat == "full" and (setup.remat_every == 1 or len(self.layers) == 1):
                # every layer checkpointed: rotary cos/sin are arguments the checkpoints hold, saved by no op
                for s in [s for s in pieces if s.name.startswith("rotary.")]:
                    self.work(s.name, s.dtype, self.tp_numel(s), fwd["embed"], bwd[first] + 1, owner="embedding")
                pieces = [s for s in pieces if not s.name.startswith("rotary.")]
            self.saved(pieces, fwd["embed"], bwd[first] + 1, "embedding", extra)
            if setup.attn_impl == "eager":  # the 4-D causal mask, built once and read by every layer
                end = fwd["head"] if self.last else clock.opt
                self.work("causal_mask", self.a, self.rows * setup.seq_len**2, fwd["embed"], end)
        for i in self.layers:
            self._layer_activations(clock, i, extra)
        if self.last:
            self.saved(head_saved(spec, setup, self.rows), fwd["head"], bwd["head"] + 1, "lm_head")
            self.saved(loss_saved(spec, setup, self.rows), fwd["loss"], bwd["loss"] + 1, "loss")

    def _layer_activations(self, clock: _Clock, i: int, extra: int) -> None:
        """Layer ``i``'s saved tensors; a checkpointed layer keeps its input and recomputes the rest."""
        setup, fwd, bwd = self.setup, clock.fwd, clock.bwd
        lm = _layer_module(self.spec, i)
        pieces = layer_saved(self.spec, setup, self.rows, i)
        if setup.remat == "selective":
            pieces = [s for s in pieces if not s.core]
        checkpointed = setup.remat == "full" and (i - self.layers[0]) % setup.remat_every == 0
        if not checkpointed:
            for s in pieces:
                self.saved([s], fwd[f"{_block_of(s.name)}{i}"], bwd[f"{_release_of(s.name)}{i}"] + 1, lm, extra)
            return
        kept = [Saved(f"{lm}.checkpoint.input", self.rows * setup.seq_len * self.spec.hidden_size, self.a, False)]
        self.saved(kept, fwd[f"attn{i}"], bwd[f"attn{i}"] + 1, lm, extra)
        # recomputed at the start of the layer's backward: its saved tensors live again until used
        for s in pieces:
            until = bwd[f"{_release_of(s.name)}{i}"] + 1
            self.work(f"{s.name}.recomputed", s.dtype, self.tp_numel(s), bwd[f"mlp_out{i}"], until)
        if setup.device == "cpu":  # on CUDA the generator states are host memory
            self._checkpoint_rng_states(lm, fwd[f"attn{i}"], bwd[f"mlp_out{i}"], bwd[f"attn{i}"] + 1)

    def _checkpoint_rng_states(self, owner: str, start: int, recompute: int, end: int) -> None:
        """The CPU generator's state a checkpointed layer copies (``preserve_rng_state``): kept from its
        forward to the end of its backward, and a second copy ``fork_rng`` takes while it recomputes."""
        for name, alloc, free in (("kept", start, end), ("recompute", recompute, recompute + 1)):
            self.add(
                f"{owner}.rng_state.{name}",
                Category.OTHER,
                RNG_STATE_ROLE,
                "uint8",
                CPU_RNG_STATE_BYTES,
                owner=owner,
                alloc_event=alloc,
                free_event=free,
            )

    def _loss_workspace(self, clock: _Clock) -> None:
        """Around the loss: bf16 logits held in the output until the loss is computed, their fp32 copy, the
        gradient of log-softmax's input and output, then the cast back to the logits' dtype."""
        fwd, bwd, a = clock.fwd, clock.bwd, self.a
        nv = _div(self.rows * self.setup.seq_len * self.spec.vocab_size, self.t)  # vocabulary-parallel logits
        self.work("logits", a, nv, fwd["head"], fwd["loss"] + 1)
        if a != "float32":
            self.work("logits.fp32", "float32", nv, fwd["loss"])
        self.work("log_softmax.grad_output", "float32", nv, bwd["loss"])
        self.work("log_softmax.grad_input", "float32", nv, bwd["loss"], bwd["cast"] + 1)
        if a != "float32":
            self.work("logits.grad", a, nv, bwd["cast"], bwd["head"] + 1)
        self.work("lm_head.grad_input", a, self._residual_numel(), bwd["head"])

    def _residual_numel(self) -> int:
        """Elements of the residual stream on one rank (split along the sequence with sequence parallelism)."""
        nh = self.rows * self.setup.seq_len * self.spec.hidden_size
        return _div(nh, self.t) if self.setup.sequence_parallel else nh

    def _layer_workspace(self, clock: _Clock) -> None:
        """A layer's transients: the block's output beside its input in forward (and the MLP's widest
        intermediate); in backward the gradients of the block's intermediates and of the residual stream."""
        spec, fwd, bwd, a, t = self.spec, clock.fwd, clock.bwd, self.a, self.t
        nh = self._residual_numel()
        mlp = nh + _div(self.rows * self.setup.seq_len * _mlp_width(spec), t)
        for i in self.layers:
            lm = _layer_module(spec, i)
            mlp_w, attn_w = _backward_widths(spec, self.setup, self.rows, t)
            self.work(f"{lm}.attention.output", a, nh, fwd[f"attn{i}"])
            self.work(f"{lm}.mlp.output", a, mlp, fwd[f"mlp{i}"])
            self.work(f"{lm}.mlp.output_grads", a, mlp, bwd[f"mlp_out{i}"])
            self.work(f"{lm}.mlp.grads", a, nh + mlp_w, bwd[f"mlp_act{i}"])
            self.work(f"{lm}.mlp.input_grads", a, mlp, bwd[f"mlp{i}"])
            self.work(f"{lm}.attention.output_grads", a, 2 * nh, bwd[f"attn_out{i}"])
            self.work(f"{lm}.attention.grads", attn_w[1], attn_w[0], bwd[f"attn{i}"])
            self.work(f"{lm}.residual.grad", a, nh, bwd[f"attn{i}"])

    def _gradients(self, clock: _Clock, trainable: list[_Trainable]) -> None:
        """Gradients, produced at their module's backward event and freed by ``zero_grad``; master
        gradients from their cast."""
        bwd, opt, master = clock.bwd, clock.opt, self.setup.master_dtype
        for name, n, module, layer, shape in trainable:
            if layer is not None:
                at = bwd[f"{_release_of(name)}{layer}"]
            elif module in ("lm_head",) or "ln_f" in name or "norm" in name or "final_layer" in name:
                at = bwd["head"] if self.last else bwd.get("embed", opt)
            elif self.last and self.spec.tied and _is_token_embedding(name):
                at = bwd["head"]  # a tied head's matmul produces the shared weight's gradient first
            else:
                at = bwd.get("embed", opt)
            self.add(
                f"{name}.grad",
                Category.GRADIENTS,
                "grad",
                self.a,
                n,
                alloc_event=at,
                free_event=clock.zero,
                shape=shape,
            )
            if master:
                at = clock.casts[name]
                self.add(
                    f"{name}.master.grad",
                    Category.GRADIENTS,
                    "master_grad",
                    master,
                    n,
                    alloc_event=at,
                    free_event=clock.zero,
                    shape=shape,
                )
        if self.first and self.spec.tied and self.setup.lora_rank == 0:
            # the embedding's own gradient is computed whole, then accumulated into the head's
            self.work(
                "embedding.grad_contribution",
                self.a,
                _div(self.spec.vocab_size * self.spec.hidden_size, self.t),
                bwd["embed"],
            )

    def _optimizer_temporaries(self, opt: int, trainable: list[_Trainable]) -> None:
        state = self.setup.master_dtype or self.setup.moment_dtype
        if self.setup.optimizer in ("adamw", "adam") and trainable:
            if self.setup.device == "cpu":  # per tensor: sqrt(v) and sqrt(v)/c live together
                self.work("optimizer.denominator", state, 2 * max(n for _, n, *_ in trainable), opt)
            else:  # foreach: one temporary per state tensor, all at once
                self.work("optimizer.denominator", state, sum(n for _, n, *_ in trainable), opt)


_ATTN, _MLP = "attention", "mlp"
_MLP_KEYS = ("mlp.", "post_attention_layernorm", "ln_2", "resid_dropout1")


def _block_of(name: str) -> str:
    """Which half of a decoder layer a saved tensor or a parameter belongs to."""
    return "mlp" if any(k in name for k in _MLP_KEYS) else "attn"


_OUTPUT_PROJECTIONS = {
    "mlp_out": (
        "down_proj",
        "mlp.c_proj",
        "dense_4h_to_h",
        "fc2",
        "mlp.down.input",
        "experts.product",
        "experts.down",
        "experts.routing_weight",
        "experts.scatter_index",
        "resid_dropout1",  # the dropout after a block's output projection: its backward runs first
    ),
    "attn_out": ("o_proj", "attn.c_proj", "attention.dense", "self_attn.dense", "resid_dropout0"),
}


def _release_of(name: str) -> str:
    """The backward event that releases a saved tensor or produces a parameter's gradient."""
    for event, keys in _OUTPUT_PROJECTIONS.items():
        if any(k in name for k in keys):
            return event
    return _block_of(name)


def _mlp_width(spec: ArchSpec) -> int:
    if spec.moe:
        return spec.intermediate_size * spec.top_k
    return spec.intermediate_size


def _backward_widths(spec: ArchSpec, setup: Setup, rows: int, t: int) -> tuple[int, tuple[int, str]]:
    """Elements of the gradients in flight during a block's backward: the MLP's (three of its width) and
    the attention's (the T×T gradients in eager, in fp32 for the fp32-softmax families; q, k, v otherwise)."""
    N = rows * setup.seq_len
    if spec.moe:  # the experts' gate/up gradients and the gathered tokens' gradient
        mlp = 2 * _div(N * _mlp_width(spec), t) + _div(N * spec.top_k * spec.hidden_size, t)
    else:
        mlp = 3 * _div(N * _mlp_width(spec), t)
    if setup.attn_impl == "eager":
        scores = 2 * _div(rows * spec.num_heads * setup.seq_len * setup.seq_len, t)
        return mlp, (scores, setup.weight_dtype if spec.family == "gpt2" and not spec.upcast_attn else "float32")
    return mlp, (3 * _div(N * spec.num_heads * spec.head_dim, t), setup.weight_dtype)


_LAYER_RE = re.compile(r"^((?:reference\.)?(?:model\.layers|transformer\.h|gpt_neox\.layers)\.\d+)\.")


def compact(ledger: Ledger) -> Ledger:
    """The same step with each layer's arrays merged per half-block, category, role, dtype and lifetime.

    Peaks and totals are unchanged (up to a few bytes of per-tensor step counters); the sharding
    transform runs ten times faster on it, which is what the ``fit`` search needs. A parameter's state made
    during the step one parameter at a time (a master copy's fp32 gradient, cast in the optimizer step) stays
    one entry per parameter: merged per lifetime, a group would hold some of a half-block's parameters, not
    the length of their merged weight, and sharding keeps such state whole (ZeRO-2 and 3 counted every
    rank's master gradients on each).
    """
    groups: dict[tuple[object, ...], list[Entry]] = {}
    singles: list[Entry] = []
    for e in ledger.entries:
        name = e.name.removeprefix("optimizer.")
        m = _LAYER_RE.match(name)
        if m is None or (e.category == Category.GRADIENTS and e.role == "master_grad"):
            singles.append(e)
            continue
        group = f"{m.group(1)}.{_release_of(name)}"
        key = (group, e.category, e.role, e.dtype, e.alloc_event, e.free_event)
        groups.setdefault(key, []).append(e)
    merged = list(singles)
    for (group, category, role, dtype, alloc, free), members in groups.items():
        if category in (Category.WEIGHTS, Category.FROZEN):
            name = f"{group}.params"
        elif category == Category.GRADIENTS:
            name = f"{group}.params.master.grad" if role == "master_grad" else f"{group}.params.grad"
        elif category == Category.OPTIMIZER:
            name = f"optimizer.{group}.params.{role}"
        else:
            name = f"{group}.{category}.{dtype}"
        if role == "step":
            numel = 1  # one counter per merged group
        else:
            numel = sum(e.numel for e in members)
        first = members[0]
        merged.append(
            Entry(
                name=name,
                category=first.category,
                role=role,
                dtype=dtype,
                numel=numel,
                nbytes=numel * DTYPE_BYTES[dtype],
                device=first.device,
                owner=group,
                alloc_event=alloc,
                free_event=free,
                evidence=first.evidence,
            )
        )
    return ledger.with_entries(merged)


def _layer_module(spec: ArchSpec, i: int) -> str:
    return {"gpt2": f"transformer.h.{i}", "gpt_neox": f"gpt_neox.layers.{i}"}.get(spec.family, f"model.layers.{i}")


def _embed_module(spec: ArchSpec) -> str:
    return {"gpt2": "transformer.wte", "gpt_neox": "gpt_neox.embed_in"}.get(spec.family, "model.embed_tokens")


def _is_token_embedding(name: str) -> bool:
    return any(k in name for k in ("embed_tokens", "embed_in", "wte"))


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def check_lora(spec: ArchSpec, setup: Setup) -> None:
    """The LoRA targets name linears of the model, and the rank is no more than one of them can use: a rank-r
    update of a d_out x d_in weight has rank at most min(d_in, d_out), and a larger r only adds parameters."""
    from trainledger.errors import InputError

    targets = lora_targets(setup, spec)
    tensors = param_tensors(spec)
    linears = sorted({p.lora_target for p in tensors if p.lora_target})
    if not set(targets) & set(linears):
        raise InputError(
            f"LoRA targets {','.join(targets)} match no linear layer of this {spec.family} model; "
            f"it has: {', '.join(linears)}"
        )
    most = max(min(p.lora_dims) for p in tensors if p.lora_target in targets)
    if setup.lora_rank > most:
        raise InputError(
            f"LoRA rank {setup.lora_rank:,} is more than {most:,}, the smaller side of the largest adapted weight: "
            f"an update of that weight has rank at most {most:,}; give a rank up to {most:,}"
        )


def analytic_ledger(spec: ArchSpec, setup: Setup) -> Ledger:
    """The analytic ledger of one training step of ``spec`` run as ``setup`` (one rank, before ZeRO).

    With pipeline parallelism the ledger is of ``setup.pipeline_stage`` (default: the stage whose peak is
    largest). Shard it across data-parallel ranks with :func:`trainledger.shard.shard`.

    Example:
        >>> from trainledger.analytic import arch_from_config
        >>> spec = arch_from_config({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
        ...     "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32})
        >>> led = analytic_ledger(spec, Setup(micro_batch=1, seq_len=4096))
        >>> led.evidence.value, led.num_params()
        ('analytic', 6738415616)
    """
    if setup.pipeline_parallel > spec.num_layers:
        from trainledger.errors import InputError

        raise InputError(
            f"pipeline-parallel degree {setup.pipeline_parallel} exceeds the model's {spec.num_layers} layers"
        )
    if setup.tensor_parallel > 1 and spec.num_kv_heads % setup.tensor_parallel:
        from trainledger.errors import InputError

        raise InputError(
            f"tensor-parallel degree {setup.tensor_parallel} does not divide the {spec.num_kv_heads} key/value heads"
        )
    if setup.lora_rank:
        check_lora(spec, setup)
    stages = [setup.pipeline_stage] if setup.pipeline_stage is not None else list(range(setup.pipeline_parallel))
    best: Ledger | None = None
    for s in stages:
        led = _Builder(spec, setup, s).build()
        if best is None or led.peak().bytes > best.peak().bytes:
            best = led
            chosen = s
    assert best is not None
    notes = [EXCLUDED]
    if setup.lora_rank and set(lora_targets(setup, spec)) <= set(lora_targets(replace(setup, lora_targets=()), spec)):
        notes.append("LoRA: saved activations within 3% of autograd's (exact for the Llama family, NeoX, Mixtral)")
    elif setup.lora_rank:  # what each other target saves is not modelled as closely
        notes.append(
            "LoRA on other linears than the family's usual ones: saved activations are not validated there (up to "
            "24% high on a Llama with down_proj alone); trace --hf-config ... --fake gives the exact figure"
        )
    if setup.remat == "selective" and setup.attn_impl != "eager":
        notes.append(
            "selective recomputation drops the attention's T×T tensors, which fused attention (sdpa) never keeps: "
            "it changes nothing here (with --attn eager it does)"
        )
    if setup.remat == "full":
        notes.append(
            "full recomputation: a recomputed layer's temporaries are approximated from its saved tensors; Mixtral's "
            "recomputed routing (fp32 scatter buffers) is not modelled: the peak may be a few percent low"
            if spec.moe
            else "full recomputation: a recomputed layer's temporaries are approximated from its saved tensors "
            "(workspace within 4%, the peak within 2% of the fake trace on small configs)"
        )
    if setup.pipeline_parallel > 1:
        notes.append(
            f"pipeline stage {chosen} of {setup.pipeline_parallel} (1F1B: {setup.pipeline_parallel - chosen} "
            "micro-batches of activations in flight)"
        )
    meta = {
        "family": spec.family,
        "num_params": sum(p.numel for p in param_tensors(spec)),
        "num_trainable_params": best.num_params(),
        "setup": setup_to_dict(setup),
        "pipeline_stage": chosen,
    }
    return Ledger(
        best.entries, best.events, evidence=Evidence.ANALYTIC, device=setup.device, notes=tuple(notes), meta=meta
    )


def saved_bytes_per_layer(spec: ArchSpec, setup: Setup, layer: int = 0) -> int:
    """Bytes one decoder layer saves for backward under the setup's recomputation policy (before
    tensor/sequence parallel division): ``full`` keeps the checkpointed layer's input only."""
    rows = setup.micro_batch * (2 if setup.reference else 1)
    pieces = layer_saved(spec, setup, rows, layer)
    if setup.remat == "full" and layer % setup.remat_every == 0:
        return rows * setup.seq_len * spec.hidden_size * DTYPE_BYTES[setup.weight_dtype]
    if setup.remat == "selective":
        pieces = [s for s in pieces if not s.core]
    return sum(s.nbytes for s in pieces)


def step_flops(spec: ArchSpec, setup: Setup) -> tuple[float, float]:
    """Forward and backward FLOPs of one micro-batch (matmuls only; Narayanan et al. 2021, eq. 3 terms).

    Returns ``(forward, recompute)``: backward is twice forward; ``recompute`` is what rematerialization
    adds (a layer's forward again under ``full``; the attention scores and values under ``selective``).
    """
    rows = setup.micro_batch * (2 if setup.reference else 1)
    N = rows * setup.seq_len
    H, I, L, V = spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.vocab_size
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    proj = H * (2 * q_out + 2 * kv_out)
    mlp = (3 if spec.gated_mlp else 2) * H * I * (spec.top_k if spec.moe else 1)
    attn = 2 * setup.seq_len * q_out  # QKᵀ and PV per token
    per_layer = 2 * N * (proj + mlp + attn)
    forward = L * per_layer + 2 * N * H * V
    if setup.remat == "full":
        recompute = math.ceil(L / setup.remat_every) * per_layer
    elif setup.remat == "selective":
        recompute = L * 2 * N * attn
    else:
        recompute = 0.0
    return float(forward), float(recompute)
