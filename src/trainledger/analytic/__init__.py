"""The analytic model: a closed-form ledger of a Hugging Face architecture's training step (no torch).

Parameter counts are exact (equal to ``transformers``' own count); activations are listed tensor by
tensor as each family's implementation saves them; the step is laid on a coarse event clock (per layer
and block in forward and backward, the head, the loss, the optimizer) so the peak is taken at one
instant. Evidence ``analytic``: an estimate, not a claim about a run.

Example:
    >>> from trainledger.analytic import Setup, estimate
    >>> r = estimate({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    ...     "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32},
    ...     Setup(micro_batch=1, seq_len=4096), world=8, stage="3")
    >>> r.num_params, r.ledger.evidence.value
    (6738415616, 'analytic')
"""

from trainledger.analytic._activations import lora_targets
from trainledger.analytic._arch import FAMILIES, ArchSpec
from trainledger.analytic._config import (
    arch_from_config,
    load_config_file,
    normalized_config,
    unmodelled,
    unmodelled_activation,
)
from trainledger.analytic._estimate import EstimateResult, check_positions, estimate
from trainledger.analytic._fit import Candidate, FitOptions, FitResult, fit, with_traced_peaks
from trainledger.analytic._model import analytic_ledger, check_lora, compact, saved_bytes_per_layer, step_flops
from trainledger.analytic._params import ParamTensor, num_params, param_tensors
from trainledger.analytic._setup import OPTIMIZERS, RECIPES, REMATS, Setup

__all__ = [
    "FAMILIES",
    "OPTIMIZERS",
    "RECIPES",
    "REMATS",
    "ArchSpec",
    "Candidate",
    "EstimateResult",
    "FitOptions",
    "FitResult",
    "ParamTensor",
    "Setup",
    "analytic_ledger",
    "arch_from_config",
    "check_lora",
    "check_positions",
    "compact",
    "estimate",
    "fit",
    "load_config_file",
    "lora_targets",
    "normalized_config",
    "num_params",
    "param_tensors",
    "saved_bytes_per_layer",
    "step_flops",
    "unmodelled",
    "unmodelled_activation",
    "with_traced_peaks",
]
