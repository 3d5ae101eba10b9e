"""Hugging Face transformers causal LMs trained as they are: `model.name = "hf"` with `model.hf_config`.

The model is transformers' own (`AutoModelForCausalLM.from_config`), with its own module and parameter names;
`HFCausalLM` only runs its submodules in the model's order, so that a pipeline stage can hold a slice of them
and sequence parallelism can shard the residual stream. transformers is imported when such a model is built.
"""

from torchpre.models.hf.args import SUPPORTED_MODEL_TYPES, HFArgs, hf_args
from torchpre.models.hf.model import HFCausalLM, decoder_stages

__all__ = ["SUPPORTED_MODEL_TYPES", "HFArgs", "HFCausalLM", "decoder_stages", "hf_args"]
