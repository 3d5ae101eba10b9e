"""The files of a Hugging Face model folder besides the weights, as `save_pretrained` lays them out: config.json,
generation_config.json and the tokenizer's files (`Tokenizer.hf_files`: a tiktoken file as `tokenizer.model` with a
`tokenizer_config.json` with which `transformers.AutoTokenizer` loads it, a Hugging Face tokenizer as the
tokenizer.json and tokenizer_config.json it was read from); and safetensors weights, in one file or in several with
an index.
Shared by `python -m torchpre.convert dcp-to-hf` and the exports written during training.

Every file is written under a new name and renamed into place (`torchpre.confined`), so that a symbolic link at a
name is replaced, never written through, even in a folder that was not new."""

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from torchpre.checkpoint.folders import MARKER
from torchpre.checkpoint.integrity import MANIFEST, file_record, write_manifest
from torchpre.confined import is_regular_file, replacing_path, write_file
from torchpre.data.tokenizer import Tokenizer
from torchpre.json_input import JsonValue
from torchpre.models.args import ModelArgs
from torchpre.models.registry import HFAdapter

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def shard_file_name(number: int, count: int) -> str:
    """transformers' name for the `number`-th (from 1) of `count` safetensors files."""
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def save_safetensors(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    with replacing_path(path) as temporary:
        save_file(state_dict, temporary, metadata={"format": "pt"})


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """`model.safetensors.index.json`: which file holds each tensor, and the bytes of them all."""
    write_json(folder / INDEX, {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))})


def write_metadata(
    folder: Path, adapter: HFAdapter, args: ModelArgs, tokenizer: Tokenizer, max_length: int, dtype: str
) -> None:
    """config.json (weights in `dtype`, e.g. "float32"), generation_config.json and the tokenizer files.
    `max_length`: the longest context the weights are meant for (it changes neither the weights nor RoPE)."""
    tokens = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    config = adapter.hf_config(args, **tokens, torch_dtype=dtype, max_position_embeddings=max_length)
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", tokens)
    for name, data in tokenizer.hf_files(max_length).items():
        write_file(folder / name, data)


def give_default_modes(folder: Path) -> None:
    """safetensors writes its files with mode 0600; give every file the mode the user's umask gives new files."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if is_regular_file(path):  # a link's mode is its target's: never changed through it
            path.chmod(0o666 & ~umask)


def sign_folder(folder: Path, signing_key: bytes) -> None:
    """Signs the finished folder (checkpoint.signing_key_file): a manifest of every regular file's size, CRC-32 and
    SHA-256, signed as a checkpoint's is (`torchpre.checkpoint.integrity`), so that a job holding the key loads it as
    its own and refuses it altered. torchpre's marker is left out: the folder loses it once published. The files are
    read once more here: the weights were written by safetensors, which reports no digest."""
    files = {}
    for path in sorted(folder.iterdir()):
        if is_regular_file(path) and path.name not in (MANIFEST, MARKER):
            files[path.name] = file_record(path)
    write_manifest(folder, "write", files, signing_key)


def write_json(path: Path, value: JsonValue) -> None:
    write_file(path, json.dumps(value, indent=2) + "\n")
