"""What autograd saves for backward in each family's ``transformers`` implementation, tensor by tensor.

Each function lists the saved tensors of one decoder layer (or of the embeddings, or of the head and
loss) as :class:`Saved` records, read off the modelling code and checked against
``torch.autograd.graph.saved_tensors_hooks`` on small models (``tests/test_analytic_activations.py``,
which counts unique storages during a real forward). Tensors shared by several ops are listed once.

Notation: ``N = B·T`` tokens, ``a`` the activation dtype's bytes, ``nh``/``nkv`` query and key/value
heads of ``hd`` dims, ``I`` the MLP width, ``V`` the vocabulary. The attention-core tensors (the ones
Korthikanti et al. 2022 recompute under selective recomputation) are flagged ``core``; tensors inside the
tensor-parallel region (split by Megatron's column/row-parallel linears) are flagged ``tp_split``.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainledger.analytic._arch import ArchSpec
from trainledger.analytic._setup import Setup
from trainledger.devices import SdpaBackend, SdpaCall, sdpa_backend
from trainledger.units import DTYPE_BYTES


@dataclass(frozen=True, slots=True)
class Saved:
    """One tensor autograd keeps for backward."""

    name: str
    numel: int
    dtype: str
    tp_split: bool = True
    """Split across tensor-parallel ranks (inside attention/MLP); otherwise split only with sequence parallelism."""
    core: bool = False
    """Attention core (scores, softmax, dropout of the T×T matrix): dropped under selective recomputation."""

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def _trains(setup: Setup, spec: ArchSpec, linear: str) -> bool:
    """Does this linear's weight (or its LoRA adapter) need the input saved?"""
    if setup.lora_rank == 0:
        return True
    return linear in lora_targets(setup, spec)


def lora_targets(setup: Setup, spec: ArchSpec) -> tuple[str, ...]:
    """The last names of the linears LoRA adapts: the setup's, or the family's usual ones."""
    if setup.lora_targets:
        return setup.lora_targets
    return {"gpt2": ("c_attn",), "gpt_neox": ("query_key_value",)}.get(spec.family, ("q_proj", "v_proj"))


def _lora(setup: Setup, spec: ArchSpec, linear: str, rows: int, prefix: str) -> list[Saved]:
    """A LoRA adapter saves ``x Aᵀ`` (N × r) for the gradient of B."""
    if setup.lora_rank and linear in lora_targets(setup, spec):
        return [Saved(f"{prefix}{linear}.lora_A.out", rows * setup.seq_len * setup.lora_rank, _act(setup), False)]
    return []


def _act(setup: Setup) -> str:
    return setup.weight_dtype


def _norm(spec: ArchSpec, setup: Setup, name: str, N: int, *, with_input: bool = True) -> list[Saved]:
    """RMSNorm (Llama's: fp32 upcast of the input, rsqrt, normalised cast back) or LayerNorm (input, mean, rstd)."""
    H, a = spec.hidden_size, _act(setup)
    if spec.norm == "rmsnorm":
        out = [Saved(f"{name}.input_fp32", N * H, "float32", False), Saved(f"{name}.rstd", N, "float32", False)]
        if not setup.lora_rank:  # weight · normed keeps normed only for the weight's gradient
            out.append(Saved(f"{name}.normed", N * H, a, False))
        return out
    stat = a if setup.device == "cpu" else "float32"  # CPU keeps mean/rstd in the input dtype, CUDA in fp32
    out = [Saved(f"{name}.mean", N, stat, False), Saved(f"{name}.rstd", N, stat, False)]
    if with_input:
        out.insert(0, Saved(f"{name}.input", N * H, a, False))
    return out


def _head_norm(spec: ArchSpec, setup: Setup, name: str, rows: int) -> list[Saved]:
    """A LayerNorm over each head (Phi's ``qk_layernorm``): its input, and mean and rstd per head and token."""
    stat = _act(setup) if setup.device == "cpu" else "float32"
    return [
        Saved(f"{name}.input", rows * spec.head_dim, _act(setup)),
        Saved(f"{name}.mean", rows, stat),
        Saved(f"{name}.rstd", rows, stat),
    ]


def _mask(setup: Setup) -> str:
    """Dropout keeps a bool mask on CUDA (native_dropout), a mask in the activation dtype on CPU."""
    return "bool" if setup.device == "cuda" else _act(setup)


def sliding(spec: ArchSpec, setup: Setup, layer: int) -> bool:
    """Does the layer attend through a sliding-window mask? transformers skips the mask (``is_causal``) while
    the sequence is shorter than the window."""
    return bool(spec.sliding_window) and layer >= spec.sliding_from and setup.seq_len >= spec.sliding_window


def sdpa_backend_of(spec: ArchSpec, setup: Setup, masked: bool = False) -> SdpaBackend | None:
    """The SDPA backend a cuda step's attention runs (``None`` on the CPU): transformers passes grouped key/value
    heads through (``enable_gqa``) when there is no mask and the head dim is at most 256, and the step's causal
    attention has no mask (``is_causal``) unless a sliding window applies (``masked``)."""
    if setup.device != "cuda":
        return None
    call = SdpaCall(
        dtype=_act(setup),
        head_dim=spec.head_dim,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads if spec.head_dim <= 256 and not masked else spec.num_heads,
        has_mask=masked,
        dropout=spec.attn_dropout,
        requires_grad=True,
    )
    return sdpa_backend(setup.card, call)


def _math_attention(spec: ArchSpec, setup: Setup, rows: int, p: str) -> list[Saved]:
    """The math SDPA kernel (``_scaled_dot_product_attention_math``): q, k, v upcast to fp32 (k, v repeated to the
    query's heads), the fp32 softmax, with dropout its mask and the dropped weights (three T×T tensors). The mask
    is CUDA's fused dropout's bool one on the card, the CPU's in the (fp32) weights' dtype. Inputs already in fp32
    are not upcast: q and k are scaled into tensors of their own, and v is folded to (rows·heads, T, hd) for the
    batched product, a copy unless one sequence makes it a view; for GPT-2 and GPT-NeoX that view is of the fused
    QKV projection's output, and keeps all of it."""
    T, nh, hd = setup.seq_len, spec.num_heads, spec.head_dim
    q, scores = rows * nh * T * hd, rows * nh * T * T
    out = [Saved(f"{p}q", q, "float32"), Saved(f"{p}k", q, "float32")]
    if _act(setup) == "float32" and rows == 1 and spec.family in ("gpt2", "gpt_neox"):
        out.append(Saved(f"{p}qkv", 3 * q, "float32"))
    else:
        out.append(Saved(f"{p}v", q, "float32"))
    out.append(Saved(f"{p}softmax", scores, "float32", core=True))
    if spec.attn_dropout > 0:
        mask = "bool" if setup.device == "cuda" else "float32"
        out += [Saved(f"{p}dropout.mask", scores, mask, core=True), Saved(f"{p}dropped", scores, "float32", core=True)]
    out.append(Saved(f"{p}o_proj.input", rows * T * nh * hd, _act(setup)))
    return out


def _attention(spec: ArchSpec, setup: Setup, rows: int, p: str, masked: bool = False) -> list[Saved]:
    """The attention core between the QKV projection and the output projection (its input excluded); ``masked``:
    a sliding-window mask reaches SDPA (key/value heads repeated to the query's, the mask kept as a bias)."""
    T, nh, hd = setup.seq_len, spec.num_heads, spec.head_dim
    nkv = nh if masked and setup.attn_impl == "sdpa" else spec.num_kv_heads
    a = _act(setup)
    q = rows * nh * T * hd
    kv = rows * nkv * T * hd
    scores = rows * nh * T * T
    N = rows * T
    drop = spec.attn_dropout > 0
    out: list[Saved] = []
    if setup.attn_impl == "eager":
        # q and k·ᵀ, v (repeated to nh heads for GQA) are copied into bmm layout: three (B·nh, T, hd) tensors;
        # GPT-2's reorder_and_upcast_attn multiplies fp32 copies of q and k and keeps its softmax in fp32
        qk = "float32" if spec.upcast_attn else a
        out += [Saved(f"{p}q", q, qk), Saved(f"{p}k", q, qk), Saved(f"{p}v", q, a)]
        if spec.family == "gpt2":  # softmax in the activation dtype (fp32 when upcast)
            out.append(Saved(f"{p}softmax", scores, qk, core=True))
        else:  # softmax(dtype=float32), then .to(query.dtype): both kept (one when already fp32)
            out.append(Saved(f"{p}softmax", scores, "float32", core=True))
            if not drop and a != "float32":
                out.append(Saved(f"{p}probs", scores, a, core=True))
        if drop:
            out += [
                Saved(f"{p}dropout.mask", scores, _mask(setup), core=True),
                Saved(f"{p}dropped", scores, a, core=True),
            ]
        out.append(Saved(f"{p}o_proj.input", N * nh * hd, a))
        return out
    backend = sdpa_backend_of(spec, setup, masked)
    if masked and backend is None:  # the CPU kernel turns the bool mask into an additive one of q's dtype
        out.append(Saved(f"{p}attn_mask", rows * T * T, a))
    elif masked and backend == "efficient":  # the bias expanded to every head, its rows padded to 16
        out.append(Saved(f"{p}attn_bias", rows * nh * T * (-(-T // 16) * 16), a))
    if (drop and setup.device == "cpu") or backend == "math":
        # SDPA with dropout on CPU, or no fused CUDA kernel accepting the call: the math kernel
        return _math_attention(spec, setup, rows, p)
    # flash / memory-efficient / cuDNN: q, k, v, the output and the fp32 log-sum-exp; GQA keeps nkv heads
    if spec.family == "gpt2":  # q, k, v are views of c_attn's output: one storage
        out.append(Saved(f"{p}qkv", 3 * q, a))
    elif spec.family == "gpt_neox":  # q, k rotated into new tensors; v is a view of the fused QKV output
        out += [Saved(f"{p}q", q, a), Saved(f"{p}k", q, a), Saved(f"{p}qkv", 3 * q, a)]
    else:
        out += [Saved(f"{p}q", q, a), Saved(f"{p}k", kv, a), Saved(f"{p}v", kv, a)]
    # memory-efficient attention pads its log-sum-exp to a multiple of 32 rows (sm80+ CUDA kernels)
    lse_rows = -(-T // 32) * 32 if backend == "efficient" else T
    out += [Saved(f"{p}logsumexp", rows * nh * lse_rows, "float32"), Saved(f"{p}out", q, a)]
    if spec.family in ("gpt_neox", "phi") and backend != "efficient":
        # q is a fresh (B, nh, T, hd) tensor here (partial rotary: a cat), so is the output (flash and cuDNN lay it
        # out as the query), and the reshape before the output projection copies it; elsewhere, and always with
        # memory-efficient attention (its output is allocated (B, T, nh, hd)), no copy is made
        out.append(Saved(f"{p}o_proj.input", N * nh * hd, a))
    return out


def layer_saved(spec: ArchSpec, setup: Setup, rows: int, layer: int) -> list[Saved]:
    """Tensors one decoder layer saves for backward (with ``rows`` sequences of ``setup.seq_len``)."""
    T = setup.seq_len
    N = rows * T
    H, a = spec.hidden_size, _act(setup)
    f = spec.family
    p = {"gpt2": f"transformer.h.{layer}.", "gpt_neox": f"gpt_neox.layers.{layer}."}.get(f, f"model.layers.{layer}.")
    out: list[Saved] = []
    resid_masks = 0
    if f in ("llama", "mistral", "qwen2", "mixtral"):
        out += _norm(spec, setup, p + "input_layernorm", N)
        if any(_trains(setup, spec, n) for n in ("q_proj", "k_proj", "v_proj")):
            out.append(Saved(p + "self_attn.input", N * H, a, False))
        out += _lora(setup, spec, "q_proj", rows, p) + _lora(setup, spec, "v_proj", rows, p)
        out += _attention(spec, setup, rows, p + "self_attn.", sliding(spec, setup, layer))
        out += _norm(spec, setup, p + "post_attention_layernorm", N)
        out += _mlp(spec, setup, rows, p + "mlp.")
    elif f == "gpt2":
        out += _norm(spec, setup, p + "ln_1", N)
        if _trains(setup, spec, "c_attn"):
            out.append(Saved(p + "attn.c_attn.input", N * H, a, False))
        out += _lora(setup, spec, "c_attn", rows, p)
        out += _attention(spec, setup, rows, p + "attn.")
        out += _norm(spec, setup, p + "ln_2", N)
        out += _mlp(spec, setup, rows, p + "mlp.")
        resid_masks = 2  # after the attention and the MLP output projections
    elif f == "gpt_neox":
        out += _norm(spec, setup, p + "input_layernorm", N)
        if _trains(setup, spec, "query_key_value"):
            out.append(Saved(p + "attention.qkv.input", N * H, a, False))
        out += _lora(setup, spec, "query_key_value", rows, p)
        out += _attention(spec, setup, rows, p + "attention.")
        # parallel residual: the second norm reads the same input (already saved); sequential: a new one
        out += _norm(spec, setup, p + "post_attention_layernorm", N, with_input=not spec.parallel_residual)
        out += _mlp(spec, setup, rows, p + "mlp.")
        resid_masks = 2 if spec.resid_dropout > 0 else 0
    else:  # phi: one norm feeds attention and MLP in parallel
        out += _norm(spec, setup, p + "input_layernorm", N)
        if any(_trains(setup, spec, n) for n in ("q_proj", "k_proj", "v_proj", "fc1")):
            out.append(Saved(p + "input_layernorm.out", N * H, a, False))
        out += _lora(setup, spec, "q_proj", rows, p) + _lora(setup, spec, "v_proj", rows, p)
        if spec.qk_layernorm:
            out += _head_norm(spec, setup, f"{p}self_attn.q_layernorm", N * spec.num_heads)
            out += _head_norm(spec, setup, f"{p}self_attn.k_layernorm", N * spec.num_kv_heads)
        out += _attention(spec, setup, rows, p + "self_attn.")
        out += _mlp(spec, setup, rows, p + "mlp.")
        resid_masks = 2
    if spec.resid_dropout > 0:
        out += [Saved(f"{p}resid_dropout{i}.mask", N * H, _mask(setup), False) for i in range(resid_masks)]
    if not _trains(setup, spec, "o_proj" if f != "gpt2" else "c_proj"):
        out = [s for s in out if not s.name.endswith("o_proj.input")]
    if setup.lora_rank and layer == 0:
        out = _lora_first_layer(spec, setup, out, p)
    return out


def _lora_first_layer(spec: ArchSpec, setup: Setup, out: list[Saved], p: str) -> list[Saved]:
    """With a frozen base nothing before the first adapter needs a gradient, so the first layer saves less:
    its first norm nothing; the parallel MLP branch (NeoX, Phi) nothing; in eager attention, with ``k_proj``
    not adapted, ``QKᵀ`` keeps only K (for Q's gradient)."""
    drop = [f"{p}input_layernorm.", f"{p}ln_1."]
    if spec.parallel_residual:
        drop += [f"{p}mlp.", f"{p}post_attention_layernorm.", f"{p}resid_dropout1"]
    targets = lora_targets(setup, spec)
    if setup.attn_impl == "eager" and "k_proj" not in targets and spec.family not in ("gpt2", "gpt_neox"):
        drop.append(f"{p}self_attn.q")
    return [s for s in out if not any(s.name.startswith(d) and (d[-1] != "q" or s.name == d) for d in drop)]


def _mlp(spec: ArchSpec, setup: Setup, rows: int, p: str) -> list[Saved]:
    N = rows * setup.seq_len
    H, I, a = spec.hidden_size, spec.intermediate_size, _act(setup)
    out: list[Saved] = []
    if spec.moe:
        E, k = spec.num_experts, spec.top_k
        Nk = N * k
        if not setup.lora_rank:  # the router's input (its frozen weight needs none under LoRA)
            out.append(Saved(p + "input", N * H, a, False))
        out += [
            Saved(p + "router.softmax", N * E, "float32", False),
            Saved(p + "router.topk_index", N * k, "int64", False),
            Saved(p + "router.topk_sum", N, "float32", False),
            Saved(p + "router.weights", N * k, "float32", False),
            Saved(p + "experts.token_index", Nk, "int64", False),
            Saved(p + "experts.sort_index", Nk, "int64", False),
            Saved(p + "experts.counts", E, "int32", False),
            Saved(p + "experts.gathered", Nk * H, a),
            Saved(p + "experts.gate_up", Nk * 2 * I, a),
            Saved(p + "experts.silu", Nk * I, a),
            # what the activation keeps beyond the gate (a view of gate_up, saved above): gelu_new's three more
            *(Saved(f"{p}experts.act{i}", Nk * I, a) for i in range(1, spec.act_saved)),
            Saved(p + "experts.product", Nk * I, a),
            Saved(p + "experts.routing_weight", Nk, "float32"),
            Saved(p + "experts.down", Nk * H, a),
            Saved(p + "experts.scatter_index", Nk, "int64", False),
        ]
        if setup.lora_rank:  # frozen experts: their grouped matmuls keep no inputs
            out = [s for s in out if not s.name.endswith(("experts.gathered", "experts.product"))]
        return out
    if spec.gated_mlp:  # SwiGLU: gate, silu(gate), up, silu(gate)·up
        if _trains(setup, spec, "gate_proj") or _trains(setup, spec, "up_proj"):
            out.append(Saved(p + "input", N * H, a, False))
        # what the activation keeps of the gate (silu: the gate itself), then the product's two operands
        out += [Saved(f"{p}gate{i}", N * I, a) for i in range(spec.act_saved)]
        out += [Saved(p + "act", N * I, a), Saved(p + "up", N * I, a)]
        if _trains(setup, spec, "down_proj"):
            out.append(Saved(p + "down.input", N * I, a))
        return out
    first = {"gpt2": "c_fc", "gpt_neox": "dense_h_to_4h", "phi": "fc1"}[spec.family]
    second = {"gpt2": "c_proj", "gpt_neox": "dense_4h_to_h", "phi": "fc2"}[spec.family]
    if spec.family != "phi" and _trains(setup, spec, first):  # Phi's fc1 input is the norm output, saved above
        out.append(Saved(p + "input", N * H, a, False))
    out += [Saved(f"{p}act{i}", N * I, a) for i in range(spec.act_saved)]
    if _trains(setup, spec, second) or spec.act_keeps_output:  # the activation's output, one storage
        out.append(Saved(p + "down.input", N * I, a))
    return out


def embedding_saved(spec: ArchSpec, setup: Setup, rows: int) -> list[Saved]:
    """Saved before the first layer: rotary cos/sin (shared by every layer), positions, embedding dropout."""
    T, a = setup.seq_len, _act(setup)
    N = rows * T
    out: list[Saved] = []
    if spec.rotary_dim:
        out += [Saved("rotary.cos", T * spec.rotary_dim, a, False), Saved("rotary.sin", T * spec.rotary_dim, a, False)]
    if spec.learned_positions:
        out.append(Saved("position_ids", T, "int64", False))
    if spec.embd_dropout > 0:
        out.append(Saved("embedding.dropout.mask", N * spec.hidden_size, _mask(setup), False))
    return out


def head_saved(spec: ArchSpec, setup: Setup, rows: int) -> list[Saved]:
    """The final norm and the LM head's input (the logits themselves are not saved)."""
    N = rows * setup.seq_len
    name = {"gpt2": "transformer.ln_f", "gpt_neox": "gpt_neox.final_layer_norm", "phi": "model.final_layernorm"}
    out = _norm(spec, setup, name.get(spec.family, "model.norm"), N)
    if setup.lora_rank == 0:
        out.append(Saved("lm_head.input", N * spec.hidden_size, _act(setup), False))
    return out


def loss_saved(spec: ArchSpec, setup: Setup, rows: int) -> list[Saved]:
    """Cross-entropy on fp32-upcast logits: log_softmax's output (N × V fp32) and the shifted targets."""
    N = rows * setup.seq_len
    V = spec.vocab_size
    if setup.reference:  # DPO: per-token log-probs of the T-1 predicted positions, gathered
        M = rows * (setup.seq_len - 1)
        return [Saved("loss.log_softmax", M * V, "float32"), Saved("loss.gather_index", M, "int64", False)]
    # the labels are padded by one ignored id and shifted: one sequence's are a view of its padded row, more
    # sequences' a copy of the N ids
    return [
        Saved("loss.log_softmax", N * V, "float32"),
        Saved("loss.targets", N + 1 if rows == 1 else N, "int64", False),
        Saved("loss.total_weight", 1, "float32", False),
    ]
