"""Convert model weights between a torchpre checkpoint and a Hugging Face Llama folder.

  python -m torchpre.convert dcp-to-hf CKPT_STEP_DIR OUT_DIR --job.config_file X.toml
      [--dtype float32|bfloat16] [--max_shard_size 5GB]
  python -m torchpre.convert hf-to-dcp HF_DIR CKPT_STEP_DIR --job.config_file X.toml
      [--dtype float32|bfloat16]

The model comes from the job config exactly as the trainer builds it: model.name and model.flavor
from the registry, vocab_size from the tokenizer at model.tokenizer_path. Any --section.key
override of the job config is accepted.

dcp-to-hf reads only the "model" entry of a checkpoint step folder and writes OUT_DIR with
config.json, generation_config.json and model.safetensors (split into numbered files plus
model.safetensors.index.json above --max_shard_size, like transformers does), plus the tokenizer:
tokenizer.model (the tiktoken file) and tokenizer_config.json, which transformers.AutoTokenizer loads.

hf-to-dcp checks HF_DIR's config.json against the job's model, then writes CKPT_STEP_DIR as a
checkpoint folder holding only {"model": ...}, the job's config.toml and the manifest.json (each file's
size and CRC-32) that loading checks; start training from it with --checkpoint.initial_load_path
CKPT_STEP_DIR. dcp-to-hf checks the manifest of the folder it reads, and refuses one without a manifest
unless --checkpoint.allow_unverified is given.

--dtype casts the weights (default: keep the dtype they are stored in). Output folders are
written under a temporary name next to their final one and renamed when complete; an existing
non-empty output folder is an error.
"""

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchpre.checkpoint.integrity import FileCheck, Trust, read_signing_key, require_intact, write_manifest
from torchpre.checkpoint.reader import Loader, read_metadata
from torchpre.checkpoint.storage import RecordingWriter
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import HelpRequested, parse_args, to_toml
from torchpre.confined import confined_path
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchpre.errors import TorchpreError
from torchpre.models.registry import HFAdapter, get_model_spec
from torchpre.runtime.cli import run_entry_point
from torchpre.runtime.custom_import import import_custom_module
from torchpre.training.hf_folder import (
    INDEX,
    SAFETENSORS,
    give_default_modes,
    save_safetensors,
    shard_file_name,
    write_index,
    write_metadata,
)
from torchpre.training.model import model_args, model_context
from torchpre.training.rope import check_saved_rope

logger = logging.getLogger("torchpre")

USAGE = (
    "python -m torchpre.convert {dcp-to-hf CKPT_STEP_DIR OUT_DIR | hf-to-dcp HF_DIR CKPT_STEP_DIR} "
    "[--dtype float32|bfloat16] [--max_shard_size SIZE (dcp-to-hf)]"
)
_OPTIONS = {"dcp-to-hf": ("--dtype", "--max_shard_size"), "hf-to-dcp": ("--dtype",)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SIZE_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}


@dataclasses.dataclass(frozen=True)
class _Model:
    """The job's model as the trainer builds it, and what the Hugging Face config also needs."""

    args: Any
    hf: HFAdapter
    flavor_max_seq_len: int
    tokenizer: Tokenizer


def main(argv: list[str]) -> None:
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        raise HelpRequested
    command, source, target, options, rest = _parse_command_line(argv)
    config = parse_args(JobConfig, rest)
    import_custom_module(config.job.custom_import)
    model = _job_model(config)
    dtype = _dtype(options.get("--dtype"))
    _check_output_free(target)
    # DCP warns that it runs without a process group; that is the intent here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if command == "dcp-to-hf":
        max_shard_size = _size(options.get("--max_shard_size", "5GB"))
        check = FileCheck(source, Trust.from_settings(config.checkpoint), "dcp-to-hf CKPT_STEP_DIR")
        dcp_to_hf(source, target, model, dtype, max_shard_size, Loader(check, config.checkpoint.allow_pickle))
    else:
        hf_to_dcp(source, target, model, dtype, config)


def dcp_to_hf(
    step_dir: Path, out_dir: Path, model: _Model, dtype: torch.dtype | None, max_shard_size: int, loader: Loader
) -> None:
    dcp_state_dict = _load_dcp_model(step_dir, loader)  # its errors name the folder already
    check_saved_rope(step_dir, model.args, loader.check.trust)
    try:
        state_dict = model.hf.to_hf_state_dict(dcp_state_dict, model.args)
    except TorchpreError as error:
        raise TorchpreError(
            f"Checkpoint {step_dir}: {error} Check model.flavor (model.hf_config for model.name = 'hf') and "
            "model.tokenizer_path against its config.toml."
        ) from None
    state_dict = {name: tensor.to(dtype or tensor.dtype) for name, tensor in state_dict.items()}
    # The longest context the weights are meant for: the flavor's design context, or the training sequence
    # length if longer. It does not change the weights or RoPE frequencies.
    max_length = max(model.args.max_seq_len, model.flavor_max_seq_len)
    torch_dtype = str(next(iter(state_dict.values())).dtype).removeprefix("torch.")

    def write(folder: Path) -> None:
        write_metadata(folder, model.hf, model.args, model.tokenizer, max_length, torch_dtype)
        _save_safetensors(state_dict, folder, max_shard_size)
        give_default_modes(folder)

    _write_atomically(out_dir, write)
    logger.info(f"Wrote the Hugging Face model {out_dir} ({torch_dtype}) from {step_dir}")


def hf_to_dcp(hf_dir: Path, step_dir: Path, model: _Model, dtype: torch.dtype | None, config: JobConfig) -> None:
    if not hf_dir.is_dir():
        raise TorchpreError(
            f"Hugging Face folder {hf_dir} does not exist. Give a folder holding config.json and model.safetensors."
        )
    _check_hf_config(hf_dir / "config.json", model, config)
    loaded = dequantize_fp8_blocks(_load_safetensors(hf_dir), _read_json(hf_dir / "config.json"), hf_dir)
    hf_state_dict = {name: tensor.to(dtype or tensor.dtype) for name, tensor in loaded.items()}
    state_dict = model.hf.from_hf_state_dict(hf_state_dict, model.args)

    def write(folder: Path) -> None:
        """The checkpoint and its manifest, as a training save writes them (CRCs taken while writing)."""
        signing_key = read_signing_key(config.checkpoint.signing_key_file)
        writer = RecordingWriter(folder, crc=True, sha256=signing_key is not None)
        dcp.save({"model": state_dict}, storage_writer=writer, no_dist=True)
        with writer.fs.create_stream(folder / "config.toml", "wb") as file:
            file.write(to_toml(config).encode("utf-8"))
        write_manifest(folder, "write", writer.fs.records, signing_key)

    _write_atomically(step_dir, write)
    logger.info(f"Wrote the model-only checkpoint {step_dir} from {hf_dir}")


def dequantize_fp8_blocks(state_dict: dict[str, Tensor], hf_config: dict[str, Any], hf_dir: Path) -> dict[str, Tensor]:
    """A block-FP8 folder's weights in bfloat16 (the dtype the released models trained in), its scales dropped.

    DeepSeek-V3's released folders (`quantization_config`: quant_method 'fp8', weight_block_size [128, 128]) hold
    each linear weight in float8_e4m3fn and a float32 `weight_scale_inv` per block of it: the weight is the FP8
    value times its block's scale. A folder without a quantization_config is returned as it is; another method is
    refused by name."""
    quantization = hf_config.get("quantization_config")
    if not quantization:
        return state_dict
    method, block = quantization.get("quant_method"), quantization.get("weight_block_size")
    if method != "fp8" or not block or len(block) != 2:
        raise TorchpreError(
            f"{hf_dir / 'config.json'}: quantization_config (quant_method {method!r}, weight_block_size {block!r}) is "
            "not supported; torchpre imports unquantized folders and block-FP8 ones (quant_method 'fp8' with a "
            "weight_block_size). Dequantize the weights first."
        )
    weights = dict(state_dict)
    for scale_name in [name for name in state_dict if name.endswith(".weight_scale_inv")]:
        name = scale_name.removesuffix("_scale_inv")
        if name not in weights:
            raise TorchpreError(f"{hf_dir}: {scale_name} has no weight {name} to scale.")
        weight, scale = weights[name], weights.pop(scale_name)
        scale = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        weights[name] = (weight.float() * scale[: weight.shape[0], : weight.shape[1]]).to(torch.bfloat16)
    return weights


def _parse_command_line(argv: list[str]) -> tuple[str, Path, Path, dict[str, str], list[str]]:
    """(command, source, target, own options, the rest for the job config parser)."""
    if len(argv) < 3 or argv[0] not in _OPTIONS or any(arg.startswith("-") for arg in argv[1:3]):
        raise TorchpreError(f"usage: {USAGE} --job.config_file X.toml [--section.key VALUE ...]")
    options, rest = {}, []
    remaining = iter(argv[3:])
    for arg in remaining:
        key, eq, value = arg.partition("=")
        if key in _OPTIONS[argv[0]]:
            options[key] = value if eq else next(remaining, "")
        else:
            rest.append(arg)
    return argv[0], Path(argv[1]), Path(argv[2]), options, rest


def _dtype(name: str | None) -> torch.dtype | None:
    if name is not None and name not in _DTYPES:
        raise TorchpreError(f"--dtype {name!r} is not one of {', '.join(_DTYPES)}.")
    return _DTYPES.get(name)


def _size(text: str) -> int:
    """Bytes from '5GB', '500MB', '100KB' (powers of 10, as transformers) or a plain number."""
    match = re.fullmatch(r"(\d+)\s*([KMG]B)?", text.strip(), re.IGNORECASE)
    if not match or int(match[1]) == 0:
        raise TorchpreError(f"--max_shard_size {text!r} is not a size such as 5GB, 500MB or 100KB.")
    return int(match[1]) * _SIZE_UNITS[(match[2] or "").upper()]


def _job_model(config: JobConfig) -> _Model:
    """The model args every entry point derives from `config` (`torchpre.training.model.model_args`)."""
    spec = get_model_spec(config.model.name)
    if spec.hf is None:
        raise TorchpreError(
            f"model.name = '{config.model.name}' has no Hugging Face conversion: its ModelSpec has no `hf` adapter."
        )
    tokenizer = Tokenizer(config.model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
    return _Model(model_args(config, tokenizer), spec.hf, model_context(config, tokenizer), tokenizer)


def _load_dcp_model(step_dir: Path, loader: Loader) -> dict[str, Tensor]:
    """The "model" entry of a DCP folder, each tensor in the dtype and shape it was saved with, read once the whole
    folder matches its manifest (a folder without one only as `loader.check.trust` allows)."""
    if not step_dir.is_dir():
        raise TorchpreError(
            f"Checkpoint folder {step_dir} does not exist. Give a step-N folder that training wrote under "
            "{job.dump_folder}/{checkpoint.folder}."
        )
    if not (step_dir / ".metadata").is_file():
        raise TorchpreError(f"{step_dir} is not a torch.distributed.checkpoint folder: it has no .metadata file.")
    require_intact(step_dir, loader.check.key, loader.check.trust)
    metadata = read_metadata(step_dir, loader.check.whole_folder_checked())
    state_dict = {
        key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if not state_dict:
        raise TorchpreError(f"Checkpoint {step_dir} holds no 'model' tensors.")
    loader.load({"model": state_dict}, no_dist=True)
    return state_dict


def _check_hf_config(path: Path, model: _Model, config: JobConfig) -> None:
    try:
        mismatches = model.hf.hf_config_mismatches(_read_json(path), model.args)
    except TorchpreError as error:
        raise TorchpreError(f"{path}: {error}") from None
    if mismatches:
        raise TorchpreError(
            f"{path} does not describe the job's model ({_job_model_name(config)}, vocab_size "
            f"{model.args.vocab_size}): {'; '.join(mismatches)}. "
            "Use the job config (model, tokenizer) the weights were made with."
        )


def _job_model_name(config: JobConfig) -> str:
    if config.model.hf_config:
        return f"model.hf_config = {config.model.hf_config}"
    return f"model.flavor = '{config.model.flavor}'"


def _load_safetensors(hf_dir: Path) -> dict[str, Tensor]:
    index = hf_dir / INDEX
    if index.is_file():
        weight_map = _read_json(index)["weight_map"]
        files = {name: confined_path(hf_dir, name, index, f"weight_map[{key!r}]") for key, name in weight_map.items()}
    else:
        files = {SAFETENSORS: hf_dir / SAFETENSORS}
    state_dict = {}
    for path in sorted(set(files.values())):
        if not path.is_file():
            raise TorchpreError(f"{path} does not exist (only safetensors weights, single or sharded, are read).")
        state_dict |= load_file(path)
    return state_dict


def _save_safetensors(state_dict: dict[str, Tensor], folder: Path, max_shard_size: int) -> None:
    """One model.safetensors, or numbered files of at most max_shard_size bytes (a bigger tensor
    gets a file to itself) and an index mapping each name to its file."""
    shards: list[dict[str, Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + nbytes > max_shard_size:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += nbytes
    if len(shards) == 1:
        save_safetensors(shards[0], folder / SAFETENSORS)
        return
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = shard_file_name(number, len(shards))
        save_safetensors(shard, folder / file_name)
        weight_map |= dict.fromkeys(shard, file_name)
    write_index(folder, weight_map, sum(t.numel() * t.element_size() for t in state_dict.values()))


def _check_output_free(target: Path) -> None:
    """Before any work: the output folder must not exist or be empty (stale files would mix in)."""
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise TorchpreError(f"Output {target} already exists and is not an empty folder; remove it or choose another.")


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Runs `write` on a sibling temporary folder, then renames it to `target`, so `target` only
    ever appears complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.parent / f".tmp-{target.name}-{os.getpid()}"
    temporary.mkdir()
    try:
        write(temporary)
        os.rename(temporary, target)  # rename(2) replaces an empty folder
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise TorchpreError(f"{path} does not exist.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise TorchpreError(f"{path} is not valid JSON: {error}.") from None


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog=USAGE)
