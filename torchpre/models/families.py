"""The built-in model families, registered by name. A family's spec module does not register itself, so
the registry and the specs import in one direction: specs -> registry, and this module -> both."""

from torchpre.models.deepseek_v3 import spec as deepseek_v3
from torchpre.models.hf import spec as hf
from torchpre.models.llama3 import spec as llama3
from torchpre.models.moe import spec as moe
from torchpre.models.registry import register_model

register_model("llama3", llama3.SPEC)
register_model("moe", moe.SPEC)
register_model("hf", hf.SPEC)
register_model("deepseek_v3", deepseek_v3.SPEC)
