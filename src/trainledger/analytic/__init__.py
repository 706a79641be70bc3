"""The analytic model: a closed-form ledger of a Hugging Face architecture's training step (no torch).

Parameter counts are exact (equal to ``transformers``' own count); activations are listed tensor by
tensor as each family's implementation saves them; the step is laid on a coarse event clock (one event
per layer in forward and backward, the head, the loss, the optimizer) so the peak is taken at one instant.
Evidence ``analytic``: an estimate, not a claim about a run.
"""

from trainledger.analytic._config import FAMILIES, ArchSpec, arch_from_config, load_config_file
from trainledger.analytic._params import ParamTensor, num_params, param_tensors
from trainledger.analytic._setup import RECIPES, REMATS, Setup

__all__ = [
    "FAMILIES",
    "RECIPES",
    "REMATS",
    "ArchSpec",
    "ParamTensor",
    "Setup",
    "arch_from_config",
    "load_config_file",
    "num_params",
    "param_tensors",
]
