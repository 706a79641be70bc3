"""How a step is run: the options of the analytic model (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from trainledger.checks import MAX_MICRO_BATCH, MAX_SEQ_LEN, one_of, whole_number
from trainledger.declared import OPTIMIZER_ARRAYS
from trainledger.devices import DEFAULT_CUDA_DEVICE, Device, lookup
from trainledger.errors import InputError

Recipe = Literal["bf16-master", "bf16", "fp32"]
RECIPES: dict[str, tuple[str, str | None, str]] = {
    # name: (weights and gradients, master copy, optimizer moments)
    "bf16-master": ("bfloat16", "float32", "float32"),
    "bf16": ("bfloat16", None, "bfloat16"),
    "fp32": ("float32", None, "float32"),
}
Remat = Literal["none", "selective", "full"]
REMATS: tuple[Remat, ...] = ("none", "selective", "full")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One training step of an architecture: sizes, precision, attention, recomputation, parallelism."""

    micro_batch: int = 1
    """Sequences per micro-batch on one data-parallel rank (per side of a DPO pair with ``reference``)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    recipe: Recipe = "bf16-master"
    """``bf16-master``: bf16 weights and gradients, fp32 master copy and moments (the master gradients
    are materialised in fp32 during the step, as the bundled optimizer does); ``bf16``: everything bf16;
    ``fp32``: everything fp32."""
    optimizer: str = "adamw"
    """``adamw``, ``adam``, ``sgd`` or ``sgd-momentum``."""
    attn_impl: Literal["eager", "sdpa"] = "sdpa"
    """``eager`` materialises the (T × T) attention matrix; ``sdpa`` (flash / memory-efficient) does not."""
    device: Literal["cuda", "cpu"] = "cuda"
    """Kernels differ in what they save: on CUDA dropout keeps a 1-byte mask, LayerNorm fp32 statistics and
    AdamW runs ``foreach`` (one temporary the size of the state); on CPU the mask and statistics are in
    the activation dtype, AdamW runs per tensor, and SDPA with dropout falls back to the math kernel."""
    gpu: str | None = None
    """With ``device="cuda"``: the card from the device table (``trainledger.devices``) whose compute capability
    decides the SDPA backend and the cuBLAS workspace; ``None``: an H100 (sm90)."""
    remat: Remat = "none"
    """Activation recomputation: ``selective`` recomputes the attention core (Korthikanti et al. 2022,
    §4.2), ``full`` keeps only each checkpointed layer's input."""
    remat_every: int = 1
    """With ``full``: checkpoint every k-th layer (layers ``0, k, 2k…``); 1 = every layer."""
    lora_rank: int = 0
    """LoRA rank; 0 trains every weight."""
    lora_targets: tuple[str, ...] = ()
    """Last names of the adapted linears (default ``q_proj, v_proj``; GPT-2 ``c_attn``; NeoX ``query_key_value``)."""
    reference: bool = False
    """A frozen reference copy of the model (DPO): its forward runs under ``no_grad`` before the policy's."""
    tensor_parallel: int = 1
    """Megatron tensor-parallel degree ``t``: attention heads, MLP width and vocabulary split ``t`` ways."""
    sequence_parallel: bool = False
    """With ``t > 1``: the norms' and dropouts' activations are split along the sequence too."""
    pipeline_parallel: int = 1
    """Pipeline stages ``p`` (1F1B schedule): the first stage holds ``p`` micro-batches of activations."""
    pipeline_stage: int | None = None
    """Which stage's ledger to build; ``None``: the stage with the largest peak."""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        whole_number(self.micro_batch, "micro-batch (sequences)", limit=MAX_MICRO_BATCH)
        whole_number(
            self.seq_len,
            "sequence length (tokens)",
            minimum=2,
            limit=MAX_SEQ_LEN,
            minimum_why="the loss predicts the next token",
        )
        whole_number(self.remat_every, "recomputation interval (every k-th layer)")
        whole_number(self.tensor_parallel, "tensor-parallel degree")
        whole_number(self.pipeline_parallel, "pipeline-parallel degree (stages)")
        one_of(self.recipe, "precision recipe", RECIPES)
        one_of(self.optimizer, "optimizer", OPTIMIZERS)
        if self.recipe == "bf16-master" and self.optimizer not in ("adamw", "adam"):
            raise InputError(
                f"the bf16-master recipe (the default --dtype) keeps fp32 master weights beside AdamW's or Adam's "
                f"moments; {self.optimizer!r} has no such step here: give the fp32 or bf16 recipe (--dtype fp32)"
            )
        one_of(self.attn_impl, "attention implementation", ("eager", "sdpa"))
        one_of(self.device, "device kind", ("cuda", "cpu"))
        if self.gpu is not None:
            if self.device != "cuda":
                raise InputError(f"a GPU ({self.gpu!r}) applies to the cuda device kind, not {self.device!r}")
            lookup(self.gpu)
        one_of(self.remat, "rematerialization policy", REMATS)
        whole_number(self.lora_rank, "LoRA rank (0: off)", minimum=0)
        if not isinstance(self.lora_targets, tuple) or not all(isinstance(t, str) for t in self.lora_targets):
            raise InputError(f"LoRA targets {self.lora_targets!r} must be a tuple of linear names, e.g. ('q_proj',)")
        for name in ("reference", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} {getattr(self, name)!r} must be True or False")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise InputError(
                "sequence parallelism splits activations across tensor-parallel ranks; give a tensor-parallel "
                "degree above 1, or drop sequence parallelism"
            )
        if self.pipeline_stage is not None:
            whole_number(self.pipeline_stage, "pipeline stage", minimum=0)
            if self.pipeline_stage >= self.pipeline_parallel:
                raise InputError(
                    f"pipeline stage {self.pipeline_stage} must be in 0..{self.pipeline_parallel - 1} "
                    f"(there are {self.pipeline_parallel} stages)"
                )

    @property
    def weight_dtype(self) -> str:
        return RECIPES[self.recipe][0]

    @property
    def master_dtype(self) -> str | None:
        return RECIPES[self.recipe][1]

    @property
    def card(self) -> Device:
        """The card a cuda step runs on (``gpu``, or the H100 the cuda kind assumes by default)."""
        return lookup(self.gpu or DEFAULT_CUDA_DEVICE)

    @property
    def moment_dtype(self) -> str:
        return RECIPES[self.recipe][2]

    @property
    def optimizer_roles(self) -> tuple[str, ...]:
        return OPTIMIZER_ARRAYS[self.optimizer]

    @property
    def has_step_counter(self) -> bool:
        """Adam-family optimizers keep a scalar ``step`` tensor per parameter."""
        return self.optimizer in ("adamw", "adam")


def setup_to_dict(setup: Setup) -> dict[str, Any]:
    """A :class:`Setup` as JSON (its notes left out: the ledger carries them)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(setup).items() if k != "notes"}


def setup_from_dict(data: dict[str, Any]) -> Setup:
    """The :class:`Setup` that :func:`setup_to_dict` wrote, validated as any setup is.

    Example:
        >>> setup_from_dict(setup_to_dict(Setup(seq_len=512, lora_targets=("q_proj",)))).lora_targets
        ('q_proj',)
    """
    return Setup(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
