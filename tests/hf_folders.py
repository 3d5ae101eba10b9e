"""Released-looking Hugging Face Llama folders of any size, written tensor by tensor (never the whole model in
memory): random bf16 weights in numbered safetensors files of at most `shard_bytes` with an index, and a
config.json as `LlamaForCausalLM` has it. For the memory tests, where transformers would build the model whole."""

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from torchpre.interchange.folder import shard_file_name, write_index
from torchpre.models.llama3.args import LLAMA3_FLAVORS, TransformerArgs
from torchpre.models.llama3.hf import hf_config

# A few hundred MB in bf16 (188M parameters): the CI-sized memory test's model.
CI_SIZED = TransformerArgs(
    dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, vocab_size=32768, multiple_of=4096, max_seq_len=2048,
    rope_theta=500000.0,
)  # fmt: skip
# Llama 3.1 8B's shape: 8.03B parameters, 16.06 GB in bf16.
LLAMA_8B = dataclasses.replace(LLAMA3_FLAVORS["8B"], vocab_size=128256, max_seq_len=131072)


def llama_shapes(args: TransformerArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Llama folder with these args, by name, in the order save_pretrained writes."""
    head_dim, kv = args.dim // args.n_heads, args.n_kv_heads or args.n_heads
    shapes = {"model.embed_tokens.weight": (args.vocab_size, args.dim)}
    for layer in range(args.n_layers):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.self_attn.q_proj.weight": (args.n_heads * head_dim, args.dim),
            f"{prefix}.self_attn.k_proj.weight": (kv * head_dim, args.dim),
            f"{prefix}.self_attn.v_proj.weight": (kv * head_dim, args.dim),
            f"{prefix}.self_attn.o_proj.weight": (args.dim, args.n_heads * head_dim),
            f"{prefix}.mlp.gate_proj.weight": (args.ffn_hidden_dim, args.dim),
            f"{prefix}.mlp.up_proj.weight": (args.ffn_hidden_dim, args.dim),
            f"{prefix}.mlp.down_proj.weight": (args.dim, args.ffn_hidden_dim),
            f"{prefix}.input_layernorm.weight": (args.dim,),
            f"{prefix}.post_attention_layernorm.weight": (args.dim,),
        }
    return shapes | {"model.norm.weight": (args.dim,), "lm_head.weight": (args.vocab_size, args.dim)}


def weight_files(args: TransformerArgs, shard_bytes: int) -> list[dict[str, tuple[int, ...]]]:
    """The tensors (name -> shape) of each safetensors file of a folder written with at most `shard_bytes` a file."""
    groups: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in llama_shapes(args).items():
        nbytes = 2 * torch.Size(shape).numel()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = shape
        size += nbytes
    return groups


def write_llama_folder(folder: Path, args: TransformerArgs, shard_bytes: int = 2 * 10**9) -> int:
    """Writes the folder (random bf16 weights, seeded); returns the bytes of its weights."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    groups = weight_files(args, shard_bytes)
    weight_map, total = {}, 0
    for number, group in enumerate(groups, start=1):
        name = shard_file_name(number, len(groups))
        tensors = {key: torch.empty(shape, dtype=torch.bfloat16) for key, shape in group.items()}
        for tensor in tensors.values():
            tensor.normal_(0, 0.02, generator=generator)
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, name)
        total += sum(t.numel() * 2 for t in tensors.values())
        del tensors
    write_index(folder, weight_map, total)
    config = hf_config(args, bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return total
