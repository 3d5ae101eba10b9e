"""A stand-in for a released Hugging Face model: the tiny version of a transformers architecture's default config
(`torchpre.models.hf.tiny`, torchpre's 2,048-token vocabulary) with random weights, saved by `save_pretrained` as
released folders are: config.json, several safetensors files and their index.

    python scripts/tiny_release.py MODEL_TYPE OUT_DIR [--max_shard_size 200KB]

MODEL_TYPE is a transformers model_type: llama and deepseek_v3 load with `--model.flavor from_hf` (llama3 and
deepseek_v3 families), any decoder-only one with `--model.name hf --model.hf_config OUT_DIR`. No weights are
downloaded.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM

from torchpre.models.hf.tiny import default_tiny_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_type")
    parser.add_argument("out_dir")
    parser.add_argument("--max_shard_size", default="200KB", help="split the weights into files of this size")
    options = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(default_tiny_config(options.model_type), dtype=torch.float32)
    model.save_pretrained(options.out_dir, max_shard_size=options.max_shard_size)
    count = sum(p.numel() for p in model.parameters())
    print(f"{options.out_dir}: a random {type(model).__name__} of {count:,} parameters")


if __name__ == "__main__":
    main()
