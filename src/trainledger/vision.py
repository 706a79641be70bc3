"""timm classifiers and diffusers denoisers built from a name or a local config, for the tracer; the optional extras.

``pip install 'trainledger[timm]'`` or ``'trainledger[diffusers]'`` installs them; without, a build says so in one
line.

A diffusers model (:func:`workload_from_diffusers_config`) trains with the denoising loss on noisy latents
sized from its config; a timm model (:func:`workload_from_timm`) classifies images by name, without pretrained
weights. Either builds for a fake trace with :func:`~trainledger.anymodel.build_fake`; a timm model whose
``depth`` sets its one list of blocks can be built shallower for a stacked trace (:func:`timm_depth`).
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainledger.analytic import Setup, load_config_file
from trainledger.anymodel import build_fake, one_line, reads_values
from trainledger.checks import MAX_LATENT_SIDE, whole_number
from trainledger.errors import InputError
from trainledger.hf import optimizer_factory, quiet_transformers
from trainledger.trace import EmptyWeights
from trainledger.workload import Workload


def _extra(module: str, extra: str) -> Any:
    """An optional package, or one line naming the extra that installs it."""
    try:
        return __import__(module)
    except Exception:  # missing, or present but unusable (a torchvision built for another torch)
        raise InputError(f"this model needs {module}: pip install 'trainledger[{extra}]'") from None


class Denoiser(nn.Module):
    """A diffusers model trained with the denoising MSE loss: ``‖ε_θ(x_t, t, c) − ε‖²`` (Ho et al., 2020, eq. 14).

    The batch holds the noisy latents, timesteps and conditioning the model takes, and the ``target`` noise
    (shaped as the model's output: twice the channels where the variance is learned, as DiT's)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, target: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        out = self.inner(**inputs, return_dict=False)[0]
        return torch.nn.functional.mse_loss(out.float(), target.float())


class Classifier(nn.Module):
    """An image classifier that returns logits, trained with cross-entropy on its labels."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.inner(pixel_values).float(), labels)


@contextlib.contextmanager
def _building(mode: Any, dtype: torch.dtype, seed: int) -> Any:
    """Build under ``mode`` (a ``FakeTensorMode`` or :class:`EmptyWeights`) or seeded, with parameters created in
    ``dtype`` (converting them afterwards cannot swap fake parameters in place)."""
    if mode is None:
        torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with quiet_transformers(), mode if mode is not None else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(default)


def _check_fake(fake: bool) -> None:
    if not isinstance(fake, bool):
        raise InputError(f"fake {fake!r} must be True or False")


def _diffusers_class(raw: dict[str, Any]) -> Any:
    diffusers = _extra("diffusers", "diffusers")
    name = raw.get("_class_name")
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if cls is None or not isinstance(cls, type) or not issubclass(cls, diffusers.ModelMixin):
        raise InputError(
            f"diffusers config names _class_name {name!r}, which is no diffusers model; give the config.json of "
            "a model folder (UNet2DConditionModel, SD3Transformer2DModel, DiTTransformer2DModel, ...)"
        )
    if "timestep" not in inspect.signature(cls.forward).parameters:
        raise InputError(
            f"{name} is no denoiser (its forward takes no timestep): --diffusers-config traces a denoising step of a "
            "UNet or a diffusion transformer; trace an autoencoder with --model file.py:factory and its own loss"
        )
    return cls


def _conditioning(config: Any, params: set[str], batch: int, tokens: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the conditioning the model's ``forward`` takes, sized from its config: the text encoder's states
    at the width the model reads them (``encoder_hid_dim`` where a UNet projects them, as DeepFloyd IF's;
    ``caption_channels``, PixArt's and Sana's T5 width, projected to their ``cross_attention_dim``; SD3's and
    Flux's ``joint_attention_dim``; else a UNet's ``cross_attention_dim``), pooled projections."""
    shapes: dict[str, tuple[int, ...]] = {}
    width = (
        config.get("encoder_hid_dim")
        or config.get("caption_channels")
        or config.get("joint_attention_dim")
        or config.get("cross_attention_dim")
    )
    if "encoder_hidden_states" in params and width:
        shapes["encoder_hidden_states"] = (batch, tokens, width)
    if "pooled_projections" in params and config.get("pooled_projection_dim"):
        shapes["pooled_projections"] = (batch, config["pooled_projection_dim"])
    return shapes


_UNSYNTHESIZED = {"image", "image_hint", "text_image", "image_proj", "text_image_proj", "ip_image_proj"}
"""A UNet's ``addition_embed_type`` / ``encoder_hid_dim_type`` conditioned on image embeddings (Kandinsky's),
which no config sizes."""


def _added_conditions(config: Any, params: set[str], batch: int) -> dict[str, tuple[int, ...]]:
    """``added_cond_kwargs``' shapes for a UNet whose ``addition_embed_type`` asks for them: SDXL's ``text_time``
    takes the pooled text embedding and the micro-conditioning ids (size, crop, target: 6 of them, the base model's;
    the refiner's 5 move 256 columns from the ids to the text embedding, the same bytes within one row), concatenated
    to ``projection_class_embeddings_input_dim`` columns."""
    if "added_cond_kwargs" not in params:
        return {}
    kinds = {config.get("addition_embed_type"), config.get("encoder_hid_dim_type")}
    refused = sorted(k for k in kinds if k in _UNSYNTHESIZED)
    if refused:
        raise InputError(
            f"this UNet is conditioned on image embeddings ({', '.join(refused)}, Kandinsky's), which no config sizes: "
            "trace it with --model file.py:factory and a batch of your own"
        )
    if config.get("addition_embed_type") != "text_time":
        return {}
    width, per_id = config.get("projection_class_embeddings_input_dim"), config.get("addition_time_embed_dim")
    if not isinstance(width, int) or not isinstance(per_id, int) or width <= per_id:
        raise InputError(
            "addition_embed_type 'text_time' needs projection_class_embeddings_input_dim and addition_time_embed_dim "
            "in the config (SDXL's: 2816 and 256)"
        )
    ids = 6 if width > 6 * per_id else (width - 1) // per_id
    return {"text_embeds": (batch, width - ids * per_id), "time_ids": (batch, ids)}


def _class_labels(config: Any, params: set[str], batch: int) -> tuple[tuple[int, ...], torch.dtype] | None:
    """The shape and dtype of the ``class_labels`` a model embeds (a class index, a timestep, a vector), or None."""
    if "class_labels" not in params:
        return None
    kind = config.get("class_embed_type")
    if kind in ("projection", "simple_projection") and config.get("projection_class_embeddings_input_dim"):
        return (batch, config["projection_class_embeddings_input_dim"]), torch.float32
    if kind == "identity":
        channels = config.get("block_out_channels") or [0]
        return (batch, config.get("time_embedding_dim") or 4 * channels[0]), torch.float32
    if kind == "timestep" or config.get("num_embeds_ada_norm") or config.get("num_class_embeds"):
        return (batch,), torch.long
    return None


def _diffusion_batch(model: nn.Module, raw: dict[str, Any], setup: Setup, side: int, mode: Any, seed: int) -> Any:
    """Noisy latents ``(B, C, side, side)`` (Flux's: ``(B, side², C)`` patches, with their position ids), timesteps,
    conditioning, class labels, and the target noise, shaped as the model's output."""

    params = set(inspect.signature(model.forward).parameters)
    config = {**raw, **dict(getattr(model, "config", None) or {})}  # the model's: diffusers fills in defaults
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    b = setup.micro_batch
    latent = "sample" if "sample" in params else "hidden_states"
    channels = config.get("in_channels", 4)  # the model's own default where the file leaves it out
    out_channels = config.get("out_channels") or channels
    # Flux reads its latents as a sequence of patches (2 x 2 latent pixels packed into in_channels), with position
    # ids for them and for the text tokens: side x side tokens (64 x 64: a 1024-pixel image)
    packed = "img_ids" in params
    image = (b, side * side, channels) if packed else (b, channels, side, side)
    shapes = {latent: image, **_conditioning(config, params, b, setup.seq_len)}
    added = _added_conditions(config, params, b)
    labels = _class_labels(config, params, b)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype) if mode is not None else torch.randn(shape, generator=gen).to(dtype)

    with mode if mode is not None else contextlib.nullcontext():
        batch: dict[str, Any] = {k: draw(s) for k, s in shapes.items()}
        steps = torch.zeros(b, dtype=torch.long) if mode is not None else torch.randint(0, 1000, (b,), generator=gen)
        batch["timestep"] = steps
        if added:
            batch["added_cond_kwargs"] = {k: draw(s) for k, s in added.items()}
        if labels is not None:
            shape, kind = labels
            batch["class_labels"] = torch.zeros(shape, dtype=kind) if kind == torch.long else draw(shape)
        if packed:
            batch["img_ids"] = torch.zeros(side * side, 3, dtype=dtype)
            batch["txt_ids"] = torch.zeros(setup.seq_len, 3, dtype=dtype)
            if config.get("guidance_embeds"):
                batch["guidance"] = torch.full((b,), 3.5)  # the distilled guidance scale Flux-dev is run at
        out = (b, side * side, out_channels) if packed else (b, out_channels, side, side)
        # the target noise stays fp32 on both paths (the loss compares in fp32), as the real build draws it
        batch["target"] = torch.zeros(out) if mode is not None else torch.randn(out, generator=gen)
    return batch


def _latent_side(value: Any, source: Any) -> int:
    """The latent pixels per side: a config's ``sample_size`` (a whole number, or a list of a height and width,
    whose first is taken) or ``latent_size``, checked in one line."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    what = f"sample_size in {source}" if source != "config" else "sample_size"
    return whole_number(value, what, limit=MAX_LATENT_SIDE)


def workload_from_diffusers_config(
    path: str | Path | dict[str, Any],
    setup: Setup,
    *,
    latent_size: int | None = None,
    fake: bool = False,
    seed: int = 0,
) -> Workload:
    """One denoising training step of a diffusers model from its local ``config.json`` (no weights read).

    Arguments:
        path: the model's ``config.json`` (its ``_class_name`` names the class), a folder holding one, or the
            config as a dict.
        setup: micro-batch, conditioning tokens (``seq_len``), precision recipe and optimizer.
        latent_size: latent pixels per side (default: the config's ``sample_size``).
        fake: build for a fake trace (full size, nothing allocated; see :func:`~trainledger.anymodel.build_fake`).
    """
    raw = dict(path) if isinstance(path, dict) else load_config_file(path)
    source = "config" if isinstance(path, dict) else path
    cls = _diffusers_class(raw)
    _check_fake(fake)
    side = _latent_side(latent_size if latent_size is not None else raw.get("sample_size", 64), source)

    def build(mode: Any) -> nn.Module:
        with _building(mode, getattr(torch, setup.weight_dtype), seed):
            try:
                return cls.from_config({k: v for k, v in raw.items() if not k.startswith("_")}).train()
            except (TypeError, ValueError) as exc:
                raise InputError(f"diffusers cannot build {cls.__name__} from {source}: {exc}") from exc
            except RuntimeError as exc:  # a size torch refuses (a negative channel count)
                if reads_values(exc):
                    raise  # build_fake builds it again without weights
                raise InputError(f"diffusers cannot build {cls.__name__} from {source}: {one_line(exc)}") from exc

    inner, made_in = build_fake(build) if fake else (build(None), None)
    batch = _diffusion_batch(inner, raw, setup, side, made_in, seed)
    name = f"{cls.__name__}:{Path(source).stem}"
    return Workload(Denoiser(inner), batch, optimizer=optimizer_factory(setup), name=name)


_SMALL_CHANNELS = 32
"""The first block's channels in a small instance; the others keep their ratio to it."""
_SMALL_GROUPS = 8
_SMALL_HEADS = 4
_SMALL_CONDITIONING = 32


def small_diffusers_config(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A diffusers model's config with the same blocks, narrow: the first block's channels 32 and the others in
    the same ratio (a multiple of 8), 8 normalization groups, 4 attention heads (``attention_head_dim``: the
    heads of SD 1.x's config, where that key counts them), a conditioning width of 32. A real step of it runs
    here in seconds, every module path of the full model kept. Returns the config and what it is, in words.

    Example:
        >>> small, what = small_diffusers_config({"_class_name": "UNet2DConditionModel",
        ...     "block_out_channels": [320, 640, 1280, 1280], "norm_num_groups": 32, "attention_head_dim": 8,
        ...     "cross_attention_dim": 768})
        >>> [small[k] for k in ("block_out_channels", "norm_num_groups", "attention_head_dim", "cross_attention_dim")]
        [[32, 64, 128, 128], 8, 4, 32]
    """
    out = dict(raw)
    channels = raw.get("block_out_channels")
    if isinstance(channels, list) and channels and all(isinstance(c, int) and c > 0 for c in channels):
        first = channels[0]
        narrow = [
            max(_SMALL_GROUPS, round(_SMALL_CHANNELS * c / first / _SMALL_GROUPS) * _SMALL_GROUPS) for c in channels
        ]
        if narrow[0] < first:
            out["block_out_channels"] = narrow
            if isinstance(raw.get("norm_num_groups"), int) and raw["norm_num_groups"] > _SMALL_GROUPS:
                out["norm_num_groups"] = _SMALL_GROUPS
    for key in ("attention_head_dim", "num_attention_heads"):
        value = raw.get(key)
        if isinstance(value, int) and value > _SMALL_HEADS:
            out[key] = _SMALL_HEADS
        elif isinstance(value, list) and any(isinstance(v, int) and v > _SMALL_HEADS for v in value):
            out[key] = [min(v, _SMALL_HEADS) for v in value]
    for key in ("cross_attention_dim", "joint_attention_dim", "caption_channels"):
        value = raw.get(key)
        if isinstance(value, int) and value > _SMALL_CONDITIONING:
            out[key] = _SMALL_CONDITIONING
    changed = [f"{k} {v}" for k, v in out.items() if v != raw.get(k)]
    return out, ", ".join(changed) or "its widths the config's"


def _timm_model(name: str, mode: Any, dtype: torch.dtype, seed: int, image_size: int | None, depth: int | None) -> Any:
    """timm's ``name`` built under ``mode`` (see :func:`_building`), ``depth`` blocks deep where given (a
    ``TypeError`` where the model takes no ``depth``)."""
    timm = _extra("timm", "timm")
    kwargs: dict[str, Any] = {} if depth is None else {"depth": depth}
    sized = {**kwargs, "img_size": image_size} if image_size else kwargs
    with _building(mode, dtype, seed):
        try:
            return timm.create_model(name, pretrained=False, **sized)
        except TypeError:  # a convolutional net takes any size and has no img_size argument
            if sized is kwargs:
                raise
            return timm.create_model(name, pretrained=False, **kwargs)


def _check_timm_name(name: str) -> None:
    timm = _extra("timm", "timm")
    if not isinstance(name, str) or not timm.is_model(name):
        raise InputError(f"timm has no model {name!r}; list them with timm.list_models('pattern*')")


def timm_skeleton(name: str, *, image_size: int | None = None, depth: int | None = None) -> nn.Module:
    """timm's ``name`` with its weights on the meta device (:class:`EmptyWeights`: no memory, nothing run),
    ``depth`` blocks deep where given."""
    _check_timm_name(name)
    return _timm_model(name, EmptyWeights(), torch.float32, 0, image_size, depth)


def _module_lists(model: nn.Module) -> dict[str, int]:
    return {p: len(m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential)}


def timm_depth(name: str, *, image_size: int | None = None) -> int | None:
    """How many blocks timm's ``name`` stacks in its one list of blocks whose length its ``depth`` argument sets
    (ViT, DeiT, BEiT, EVA: ``model.blocks``), or ``None`` for a model without one (a net of stages, such as
    ResNet and ConvNeXt, that takes no ``depth``, or one whose ``depth`` changes several lists or none).

    Found on skeletons (:func:`timm_skeleton`), not from names: the model as named, and built 3 blocks deep; one
    module list, and only one, must change its length, to 3. Whether the blocks are alike is left to the stacked
    trace's checks: a stochastic-depth schedule (``drop_path_rate`` above timm's default of 0 for the ViTs, which
    the step keeps) gives every block its own rate, and the skeleton guard refuses it.

    Example:
        >>> timm_depth("vit_large_patch16_224")  # doctest: +SKIP
        24
    """
    full = _module_lists(timm_skeleton(name, image_size=image_size))
    try:
        shallow = _module_lists(timm_skeleton(name, image_size=image_size, depth=3))
    except TypeError:  # takes no depth
        return None
    grown = [p for p, n in shallow.items() if full.get(p) != n]
    if len(grown) != 1 or shallow[grown[0]] != 3 or grown[0] not in full or len(full) != len(shallow):
        return None
    return full[grown[0]]


def workload_from_timm(
    name: str,
    setup: Setup,
    *,
    image_size: int | None = None,
    fake: bool = False,
    seed: int = 0,
    depth: int | None = None,
) -> Workload:
    """One classification training step of a timm model by name, built without pretrained weights.

    The images are ``(B, 3, image_size, image_size)`` (default: the model's own input size), the labels
    class 0, the loss cross-entropy. With ``fake``, built for a fake trace (see
    :func:`~trainledger.anymodel.build_fake`): ViT and ConvNeXt, whose drop-path schedules are read with
    ``.item()`` while they are built, get their weights on ``meta``. ``depth``: the model ``depth`` blocks deep
    (timm's own ``depth`` argument; see :func:`timm_depth`).
    """
    _check_timm_name(name)
    _check_fake(fake)
    dtype = getattr(torch, setup.weight_dtype)

    def build(mode: Any) -> nn.Module:
        try:
            return _timm_model(name, mode, dtype, seed, image_size, depth).train()
        except TypeError as exc:
            if depth is None:
                raise
            raise InputError(f"timm's {name} takes no depth ({one_line(exc)}); build it as named") from exc

    inner, made_in = build_fake(build) if fake else (build(None), None)
    side = image_size or inner.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    gen = torch.Generator().manual_seed(seed)
    shape = (setup.micro_batch, 3, side, side)
    with made_in if fake else contextlib.nullcontext():
        pixels = torch.zeros(shape, dtype=dtype) if fake else torch.randn(shape, generator=gen).to(dtype)
        labels = torch.zeros(setup.micro_batch, dtype=torch.long)
    batch = {"pixel_values": pixels, "labels": labels}
    return Workload(Classifier(inner), batch, optimizer=optimizer_factory(setup), name=f"timm:{name}")
