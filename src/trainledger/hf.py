"""Hugging Face architectures from a local ``config.json``: built on the meta device or under fake mode.

Nothing is downloaded and no remote code runs: the config is read and validated by
:func:`trainledger.analytic.arch_from_config` first (one clear line for a bad value), then handed to the
family's own ``transformers`` config class as a local object (``AutoConfig.for_model``); the Hub is
switched offline for the process before ``transformers`` is imported, and ``auto_map`` (remote code) is
dropped from the config.

The model is built

- on the ``meta`` device (instant, nothing allocated) to count its parameters;
- under ``FakeTensorMode`` for a full-scale fake trace (:func:`trainledger.trace.trace` uses a model
  built that way in its own mode);
- on the CPU, for real, for small configs (the tests compare the fake and the real trace).

The training step is the one :class:`trainledger.analytic.Setup` describes (:func:`workload_from_setup`),
so a traced step and its analytic estimate are read from the same, once-validated description.

``transformers`` is an optional dependency: ``pip install 'trainledger[hf]'``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from trainledger.analytic import (
    ArchSpec,
    Setup,
    analytic_ledger,
    arch_from_config,
    check_lora,
    check_positions,
    load_config_file,
    lora_targets,
    normalized_config,
    num_params,
)
from trainledger.checks import instance_of, whole_number
from trainledger.errors import InputError
from trainledger.workload import Workload

AttnImpl = Literal["eager", "sdpa"]
Device = Literal["meta", "cpu", "fake"]

_DROPPED_KEYS = (
    "auto_map",
    "quantization_config",
    "torch_dtype",
    "dtype",
    "attn_implementation",
    "_attn_implementation",
)


def import_transformers() -> Any:
    """``transformers``, imported with the Hub switched off, or one line naming the extra to install."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub, whatever a config names
    try:
        import transformers
    except ImportError:
        raise InputError(
            "building a Hugging Face architecture needs transformers: pip install 'trainledger[hf]'"
        ) from None
    return transformers


def config_errors() -> tuple[type[BaseException], ...]:
    """What a config class raises for values it rejects: ``TypeError``, ``ValueError``, ``KeyError``, and, since
    transformers validates configs as strict dataclasses, huggingface_hub's ``StrictDataclassError`` (a plain
    ``Exception``: GPT-Neo's ``attention_types`` not matching ``num_layers`` escaped as a traceback)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub, before strict dataclasses
        return (TypeError, ValueError, KeyError)
    return (TypeError, ValueError, KeyError, StrictDataclassError)


def config_rejected(model_type: str, exc: BaseException) -> InputError:
    """One line for a config that transformers rejects (its validators' messages span lines)."""
    return InputError(f"transformers rejects the {model_type} config: {' '.join(str(exc).split())}")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers warns about token ids outside a scaled-down vocabulary and the like: not our user's concern."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class HFConfig:
    """A validated local config: the raw dict, its memory-relevant shape, and where it came from."""

    raw: dict[str, Any]
    spec: ArchSpec
    source: str

    @property
    def name(self) -> str:
        return f"{self.spec.family}:{Path(self.source).stem if self.source else 'config'}"


def load_hf_config(path: str | Path | dict[str, Any]) -> HFConfig:
    """Read and validate a config: a ``config.json``, a folder holding one, or an already-loaded dict.

    Example:
        >>> cfg = load_hf_config({"model_type": "gpt2", "vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 4})
        >>> cfg.spec.family, cfg.spec.tied
        ('gpt2', True)
    """
    raw = copy.deepcopy(path) if isinstance(path, dict) else load_config_file(path)
    spec = arch_from_config(raw)
    return HFConfig(raw=normalized_config(raw), spec=spec, source="" if isinstance(path, dict) else str(path))


def transformers_config(cfg: HFConfig, *, attn_impl: AttnImpl = "sdpa") -> Any:
    """The family's own ``transformers`` config object, built locally from the dict (no Hub, no remote code)."""
    if attn_impl not in ("eager", "sdpa"):
        raise InputError(f"unknown attention implementation {attn_impl!r}; accepted: eager, sdpa")
    tf = import_transformers()
    # a copy: transformers edits nested dicts (rope_scaling) in place, and cfg.raw is the user's
    kwargs = {k: copy.deepcopy(v) for k, v in cfg.raw.items() if k not in (*_DROPPED_KEYS, "model_type")}
    with quiet_transformers():
        try:
            config = tf.AutoConfig.for_model(cfg.spec.family, **kwargs)
        except config_errors() as exc:
            raise config_rejected(cfg.spec.family, exc) from exc
    config._attn_implementation = attn_impl
    config.use_cache = False  # a training step keeps no key/value cache
    return config


def build_model(
    cfg: HFConfig,
    *,
    dtype: torch.dtype = torch.bfloat16,
    attn_impl: AttnImpl = "sdpa",
    device: Device = "meta",
    fake_mode: Any = None,
    seed: int = 0,
) -> nn.Module:
    """The causal-LM model of ``cfg`` (in training mode), built on ``device``.

    Arguments:
        dtype: precision of the weights.
        attn_impl: ``eager`` (explicit softmax, saves the attention matrix) or ``sdpa``.
        device: ``meta`` (no storage: counts only), ``cpu`` (real weights, small configs), or ``fake``
            (under ``fake_mode``, a ``FakeTensorMode``: full size, nothing allocated).

    Example:
        >>> cfg = load_hf_config({"model_type": "gpt2", "vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 4})
        >>> m = build_model(cfg)
        >>> sum(p.numel() for p in m.parameters()) == num_params(cfg.spec)
        True
    """
    tf = import_transformers()
    config = transformers_config(cfg, attn_impl=attn_impl)
    if device == "fake":
        if fake_mode is None:
            raise ValueError("device='fake' needs a fake_mode")
        ctx: contextlib.AbstractContextManager[Any] = fake_mode
    elif device == "meta":
        ctx = torch.device("meta")
    elif device == "cpu":
        ctx = contextlib.nullcontext()
        torch.manual_seed(seed)
    else:
        raise ValueError(f"unknown device {device!r}")
    with quiet_transformers(), ctx:
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    model.train()
    return model


# --- LoRA ---------------------------------------------------------------------------------------------


class LoRA(nn.Module):
    """A frozen base linear plus a trainable low-rank update ``B A`` (Hu et al., 2021, eq. 3).

    ``y = base(x) + (x Aᵀ) Bᵀ · alpha/rank``. Works for ``nn.Linear`` and GPT-2's ``Conv1D`` (whose
    weight is stored as ``(in, out)``).
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float | None = None) -> None:
        super().__init__()
        w = base.weight
        d_in, d_out = (w.shape[0], w.shape[1]) if type(base).__name__ == "Conv1D" else (w.shape[1], w.shape[0])
        self.base = base.requires_grad_(False)
        self.scaling = (alpha if alpha is not None else rank) / rank
        # A: small random, B: zeros, so the update starts at zero (the paper's initialisation).
        self.lora_A = nn.Parameter(torch.empty(rank, d_in, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(d_out, rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


def apply_lora(model: nn.Module, rank: int, targets: Sequence[str]) -> list[str]:
    """Freeze every weight of ``model`` and wrap the linears whose last name is in ``targets`` in :class:`LoRA`.

    Returns the wrapped modules' paths. Raises :class:`InputError` when no module matches.
    """
    if rank < 1:
        whole_number(rank, "LoRA rank")
    model.requires_grad_(False)
    wrapped = []
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            is_linear = isinstance(child, nn.Linear) or type(child).__name__ == "Conv1D"
            if child_name in targets and is_linear:
                setattr(module, child_name, LoRA(child, rank))
                wrapped.append(f"{path}.{child_name}" if path else child_name)
    if not wrapped:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise InputError(f"LoRA targets {','.join(targets)} match no linear layer; this model has: {', '.join(names)}")
    return wrapped


# --- optimizers ---------------------------------------------------------------------------------------


def optimizer_factory(setup: Setup) -> Any:
    """A factory of the trainable parameters for the setup's optimizer and recipe (master copies for
    bf16-master, which :class:`~trainledger.analytic.Setup` allows with AdamW and Adam only)."""
    name, lr = setup.optimizer, 1e-4

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        if setup.master_dtype:
            from trainledger.examples import AdamWWithMasterWeights

            return AdamWWithMasterWeights(params, lr=lr, weight_decay=0.01 if name == "adamw" else 0.0)
        if name == "adamw":
            return torch.optim.AdamW(params, lr=lr)
        if name == "adam":
            return torch.optim.Adam(params, lr=lr)
        return torch.optim.SGD(params, lr=lr, momentum=0.9 if name == "sgd-momentum" else 0.0)

    return build


# --- the workload -------------------------------------------------------------------------------------


def _dpo_loss(policy: nn.Module, reference: nn.Module) -> Any:
    """DPO (Rafailov et al., 2023, eq. 7): reference log-probs under ``no_grad`` first, then the policy's."""

    def seq_logprob(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens).logits[:, :-1].float()  # (2B, T-1, V), upcast as HF's loss does
        logp = logits.log_softmax(-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        return logp.sum(-1)  # (2B,)

    def loss_fn(_output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = torch.cat([batch["chosen"], batch["rejected"]])  # (2B, T): chosen rows first
        with torch.no_grad():
            ref = seq_logprob(reference, tokens)
        pol = seq_logprob(policy, tokens)
        n = batch["chosen"].shape[0]
        margin = (pol[:n] - ref[:n]) - (pol[n:] - ref[n:])
        return -F.logsigmoid(0.1 * margin).mean()

    return loss_fn


_MASK_CHECKS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa", "_can_skip_bidirectional_mask_xpu")
"""transformers' helpers that read a padding mask's values to decide whether SDPA may skip building a mask."""


def _unpadded(check: Any) -> Any:
    """``check`` answered for a mask without padding when the mask is a fake tensor (whose values it cannot read)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def answer(padding_mask: Any, *args: Any, **kwargs: Any) -> Any:
        return check(None if isinstance(padding_mask, FakeTensor) else padding_mask, *args, **kwargs)

    return answer


def declare_unpacked(model: nn.Module) -> None:
    """Our batches hold one unpadded sequence per row. transformers checks that by reading ``position_ids``
    (``find_packed_sequence_indices``) and the padding mask (whether SDPA may skip an explicit mask: an
    encoder–decoder's decoder, a bidirectional encoder); on fake tensors it cannot, assumes packing or padding,
    and builds an explicit mask (with SDPA: a different kernel path, repeated K/V for GQA) that the real step
    never builds. During this model's forward the checks answer as they do on the real batch."""
    from transformers import masking_utils

    originals = {
        name: getattr(masking_utils, name)
        for name in ("find_packed_sequence_indices", *_MASK_CHECKS)
        if hasattr(masking_utils, name)
    }

    def before(_module: nn.Module, _args: Any, _kwargs: Any) -> None:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
        for name in _MASK_CHECKS:
            if name in originals:
                setattr(masking_utils, name, _unpadded(originals[name]))

    def after(_module: nn.Module, _args: Any, _kwargs: Any, _output: Any) -> None:
        for name, original in originals.items():
            setattr(masking_utils, name, original)

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)


class _LossOnly(nn.Module):
    """Holds the policy for a loss computed entirely in ``loss_fn`` (DPO)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        return batch


def _check_fits_in_memory(cfg: HFConfig, setup: Setup) -> None:
    """A real (not fake) build allocates every weight, and its step the gradients, the optimizer's state, master
    copies and activations: refuse one whose analytic peak exceeds the memory this process may use (the machine's,
    or a container's limit), before the operating system stops the process for it."""
    memory = _usable_memory()
    if memory is None:  # not a POSIX system: nothing to check against
        return
    try:
        needed = analytic_ledger(cfg.spec, setup).peak().bytes
        what = "its analytic peak: weights, gradients, optimizer state and activations"
    except InputError:  # a setup the closed form does not take (the trace may): the weights alone
        copies = 2 if setup.reference else 1
        needed, what = num_params(cfg.spec) * _dtype(setup).itemsize * copies, "its weights alone"
    if needed > memory:
        raise InputError(
            f"this {cfg.spec.family} model's step needs {needed:,} bytes ({what}), more than the {memory:,} this "
            "process may use; trace it on fake tensors (fake=True, or --fake) or use the analytic estimate"
        )


def _usable_memory() -> int | None:
    """The machine's memory, or the container's limit where it is lower (cgroup v2, then v1)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            memory = min(memory, int(text))
    return memory


def workload_from_setup(
    config: str | Path | dict[str, Any] | HFConfig, setup: Setup, *, fake: bool = False, seed: int = 0
) -> Workload:
    """One training step of a Hugging Face architecture, as ``setup`` describes it, ready for
    :func:`trainledger.trace.trace`.

    Arguments:
        config: a local ``config.json``, a folder holding one, the config as a dict, or a loaded config.
        setup: the step (validated by :class:`~trainledger.analytic.Setup`): micro-batch (per DPO side
            with ``reference``), sequence length, precision recipe, optimizer, attention implementation,
            LoRA rank and targets, a DPO reference, and ``remat="full"`` (transformers' own non-reentrant
            gradient checkpointing of every ``remat_every``-th decoder layer). Its tensor, sequence and
            pipeline parallelism and ``selective`` recomputation are the analytic model's alone.
        fake: build everything under ``FakeTensorMode`` (full size, nothing allocated); trace it with
            ``trace(workload, fake=True)``.
        seed: seeds the weights and the batch of a real build.

    The batch is random token ids; with the plain causal-LM loss it is ``{"input_ids", "labels"}`` and
    the model's own (shifted, fp32-upcast) cross-entropy is the loss.

    Example:
        >>> cfg = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        ...        "num_hidden_layers": 1, "num_attention_heads": 4}
        >>> w = workload_from_setup(cfg, Setup(micro_batch=2, seq_len=16), fake=True)
        >>> tuple(w.batch["input_ids"].shape), w.name
        ((2, 16), 'llama:config')
    """
    cfg = config if isinstance(config, HFConfig) else load_hf_config(config)
    setup = instance_of(setup, Setup, "setup", "give a trainledger.Setup(micro_batch=..., seq_len=..., ...)")
    _check_traceable(cfg, setup, fake)
    mode: Any = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _policy_model(cfg, setup, mode, seed)
    reference = _reference_model(cfg, setup, mode, seed) if setup.reference else None
    batch = _batch(cfg, setup, mode, seed)
    name = cfg.name + (f"+lora{setup.lora_rank}" if setup.lora_rank else "") + ("+dpo" if setup.reference else "")
    if reference is None:
        return Workload(model, batch, optimizer=optimizer_factory(setup), name=name)
    return Workload(
        _LossOnly(model),
        batch,
        loss_fn=_dpo_loss(model, reference),
        optimizer=optimizer_factory(setup),
        reference=reference,
        name=name,
    )


def workload_from_hf_config(
    path: str | Path | dict[str, Any], *, fake: bool = False, seed: int = 0, **step: Any
) -> Workload:
    """:func:`workload_from_setup` with the step's fields as keywords (those of
    :class:`~trainledger.analytic.Setup`; ``lora_targets`` may be any sequence of names, or ``None``).

    Example:
        >>> cfg = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        ...        "num_hidden_layers": 1, "num_attention_heads": 4}
        >>> w = workload_from_hf_config(cfg, micro_batch=2, seq_len=16, fake=True)
        >>> tuple(w.batch["input_ids"].shape), w.name
        ((2, 16), 'llama:config')
    """
    targets = step.get("lora_targets")
    if targets is None or (isinstance(targets, (list, tuple)) and all(isinstance(t, str) for t in targets)):
        step["lora_targets"] = tuple(targets or ())
    return workload_from_setup(path, Setup(**step), fake=fake, seed=seed)


def _check_traceable(cfg: HFConfig, setup: Setup, fake: bool) -> None:
    """What a traced step on one device cannot run, and a real build that cannot fit this machine."""
    if not isinstance(fake, bool):
        raise InputError(f"fake {fake!r} must be True or False")
    check_positions(cfg.spec, setup)
    if setup.remat == "selective":
        raise InputError("unknown rematerialization 'selective' for a traced model; accepted: none, full")
    if setup.tensor_parallel > 1 or setup.pipeline_parallel > 1:
        raise InputError(
            "a traced step runs on one device: tensor and pipeline parallelism are modelled by the analytic "
            "estimate (trainledger estimate); give tensor_parallel=1 and pipeline_parallel=1"
        )
    if not fake:
        _check_fits_in_memory(cfg, setup)


def _dtype(setup: Setup) -> torch.dtype:
    """The weights' and activations' dtype of the setup's recipe."""
    return getattr(torch, setup.weight_dtype)


def _build(cfg: HFConfig, setup: Setup, mode: Any, seed: int) -> nn.Module:
    """The model, built for real on the CPU or, under ``mode``, on fake tensors."""
    device: Device = "cpu" if mode is None else "fake"
    try:
        return build_model(
            cfg, dtype=_dtype(setup), attn_impl=setup.attn_impl, device=device, fake_mode=mode, seed=seed
        )
    except RuntimeError as exc:  # the allocator refused the weights (a limit the memory check cannot see)
        if "can't allocate memory" not in str(exc):
            raise
        raise InputError(
            f"building this {cfg.spec.family} model ran out of memory ({' '.join(str(exc).split())[:160]}); trace "
            "it on fake tensors (fake=True, or --fake) or use the analytic estimate"
        ) from None


def _policy_model(cfg: HFConfig, setup: Setup, mode: Any, seed: int) -> nn.Module:
    """The trained model: built, LoRA adapters added, recomputation switched on."""
    if setup.lora_rank:
        check_lora(cfg.spec, setup)
    model = _build(cfg, setup, mode, seed)
    if setup.lora_rank:
        with mode if mode is not None else contextlib.nullcontext():
            apply_lora(model, setup.lora_rank, lora_targets(setup, cfg.spec))
    if setup.remat == "full":
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5.x: layers i with i % k == 0
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=kwargs, every_n_layers=setup.remat_every
            )
        elif setup.remat_every == 1:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            raise InputError(
                "checkpointing every k-th layer needs transformers with activation_checkpointing_enable (5.x)"
            )
    if mode is not None:
        declare_unpacked(model)
    return model


def _reference_model(cfg: HFConfig, setup: Setup, mode: Any, seed: int) -> nn.Module:
    """The frozen copy of the model that DPO's loss reads (its own weights: seeded apart)."""
    model = _build(cfg, setup, mode, seed + 1).requires_grad_(False)
    if mode is not None:
        declare_unpacked(model)
    return model


def _batch(cfg: HFConfig, setup: Setup, mode: Any, seed: int) -> dict[str, torch.Tensor]:
    """Random token ids (zeros on fake tensors); DPO: as many chosen as rejected sequences."""
    gen = torch.Generator().manual_seed(seed)
    shape = (setup.micro_batch, setup.seq_len)
    with mode if mode is not None else contextlib.nullcontext():

        def tokens() -> torch.Tensor:
            if mode is not None:
                return torch.zeros(shape, dtype=torch.long)
            return torch.randint(0, cfg.spec.vocab_size, shape, generator=gen)

        if setup.reference:
            return {"chosen": tokens(), "rejected": tokens()}
        ids = tokens()
        return {"input_ids": ids, "labels": ids}
