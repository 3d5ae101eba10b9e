"""Hugging Face transformers causal LMs trained as they are: `model.name = "hf"` with `model.hf_config`.

The model is transformers' own (`AutoModelForCausalLM.from_config`), with its own module and parameter names and
its own forward; `HFCausalLM` also runs it as a pipeline stage. Any decoder-only causal LM of the installed
transformers is taken (`architectures`); what each layout does with it is decided from its structure and checked
on a tiny copy before any work (`probe`, `parallelize`). transformers is imported when such a model is built.
"""

from torchpre.models.hf.args import HFArgs, hf_args
from torchpre.models.hf.model import HFCausalLM
from torchpre.models.hf.probe import decoder_stages

__all__ = ["HFArgs", "HFCausalLM", "decoder_stages", "hf_args"]
