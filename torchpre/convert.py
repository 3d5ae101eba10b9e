"""Convert model weights between a torchpre checkpoint and a Hugging Face Llama folder.

  python -m torchpre.convert dcp-to-hf CKPT_STEP_DIR OUT_DIR --job.config_file X.toml
      [--dtype float32|bfloat16] [--max_shard_size 5GB]
  python -m torchpre.convert hf-to-dcp HF_DIR CKPT_STEP_DIR --job.config_file X.toml
      [--dtype float32|bfloat16]

The model comes from the job config exactly as the trainer builds it: model.name and model.flavor
from the registry, vocab_size from the tokenizer at model.tokenizer_path. Any --section.key
override of the job config is accepted. hf-to-dcp with --model.flavor from_hf reads the model from
HF_DIR's config.json (checkpoint.initial_load_path defaults to HF_DIR).

dcp-to-hf reads only the "model" entry of a checkpoint step folder and writes OUT_DIR with
config.json, generation_config.json and model.safetensors (split into numbered files plus
model.safetensors.index.json above --max_shard_size, like transformers does), plus the tokenizer's files, which
transformers.AutoTokenizer loads: a tiktoken file as tokenizer.model with a tokenizer_config.json, a Hugging Face
tokenizer as its tokenizer.json and tokenizer_config.json.

hf-to-dcp checks HF_DIR's config.json and tensors against the job's model, reads the weights through the
reader a training job loads a folder with (--checkpoint.initial_load_path HF_DIR does that without this
step), then writes CKPT_STEP_DIR as a checkpoint folder holding only {"model": ...}, the job's config.toml
and the manifest.json (each file's size and CRC-32) that loading checks; start training from it with
--checkpoint.initial_load_path CKPT_STEP_DIR. dcp-to-hf checks the manifest of the folder it reads, and
refuses one without a manifest unless --checkpoint.allow_unverified is given.

--dtype casts the weights (default: keep the dtype they are stored in). Output folders are
written under a new temporary name next to their final one, marked as torchpre's, and renamed when complete
(torchpre/checkpoint/published.py, as checkpoints are); an existing non-empty output folder, or a symbolic link in its
place, is an error.
"""

import dataclasses
import logging
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchpre.assembly.args import check_hf_mlp, model_args, model_context
from torchpre.assembly.rope import check_saved_rope
from torchpre.assembly.tokenizer import job_tokenizer
from torchpre.checkpoint.integrity import (
    FileCheck,
    Trust,
    folder_step,
    require_intact,
    write_manifest,
)
from torchpre.checkpoint.published import write_whole
from torchpre.checkpoint.reader import Loader, read_metadata
from torchpre.checkpoint.storage import RecordingWriter
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import HelpRequested, parse_args, to_toml
from torchpre.data.tokenizer import Tokenizer
from torchpre.errors import TorchpreError, UntrustedInput
from torchpre.interchange.folder import (
    SAFETENSORS,
    give_default_modes,
    save_safetensors,
    shard_file_name,
    sign_folder,
    write_index,
    write_metadata,
)
from torchpre.interchange.load import FROM_HF, check_hf_folder, hf_weights, load_hf_weights
from torchpre.models.args import ModelArgs
from torchpre.models.registry import HFAdapter, get_model_spec
from torchpre.runtime.cli import run_entry_point
from torchpre.runtime.custom_import import import_custom_module

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

    args: ModelArgs
    hf: HFAdapter
    flavor_max_seq_len: int
    tokenizer: Tokenizer


def main(argv: list[str]) -> None:
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        raise HelpRequested
    command, source, target, options, rest = _parse_command_line(argv)
    config = parse_args(JobConfig, rest)
    if command == "hf-to-dcp" and config.model.flavor == FROM_HF and not config.checkpoint.initial_load_path:
        config.checkpoint.initial_load_path = str(source)  # the model comes from HF_DIR; its config.toml says so
    import_custom_module(config.job.custom_import)
    trust = Trust.from_settings(config.checkpoint)  # the signing key, read once: it checks what is read, signs output
    if command == "hf-to-dcp":  # before its config.json gives the model's shape
        check_hf_folder(source, trust, config.checkpoint.allow_unsigned_hf, "hf-to-dcp HF_DIR")
    model = _job_model(config)
    dtype = _dtype(options.get("--dtype"))
    _check_output_free(target)
    # DCP warns that it runs without a process group; that is the intent here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if command == "dcp-to-hf":
        max_shard_size = _size(options.get("--max_shard_size", "5GB"))
        check = FileCheck(source, trust, "dcp-to-hf CKPT_STEP_DIR")
        dcp_to_hf(source, target, model, dtype, max_shard_size, Loader(check, config.checkpoint.allow_pickle))
    else:
        hf_to_dcp(source, target, model, dtype, config, trust.signing_key)


def dcp_to_hf(
    step_dir: Path, out_dir: Path, model: _Model, dtype: torch.dtype | None, max_shard_size: int, loader: Loader
) -> None:
    dcp_state_dict = _load_dcp_model(step_dir, loader)  # its errors name the folder already
    check_saved_rope(step_dir, model.args, loader.check.trust, loader.allow_pickle)
    signing_key = loader.check.trust.signing_key  # a job holding the key signs what it exports
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
        if signing_key is not None:
            sign_folder(folder, signing_key)

    write_whole(out_dir, write)
    logger.info(f"Wrote the Hugging Face model {out_dir} ({torch_dtype}) from {step_dir}")


def hf_to_dcp(
    hf_dir: Path, step_dir: Path, model: _Model, dtype: torch.dtype | None, config: JobConfig, signing_key: bytes | None
) -> None:
    """The folder's weights into whole tensors (in `dtype`, default their own) through the reader a training job loads
    a folder with (`torchpre.interchange.load`), saved as a model-only checkpoint, signed with `signing_key`."""
    weights = hf_weights(hf_dir, get_model_spec(config.model.name), model.args, "hf-to-dcp HF_DIR")
    state_dict = {name: torch.empty(size, dtype=dtype or weights.dtype(name)) for name, size in weights.shapes.items()}
    report = load_hf_weights(weights, state_dict, no_dist=True)

    def write(folder: Path) -> None:
        """The checkpoint and its manifest, as a training save writes them (CRCs taken while writing)."""
        writer = RecordingWriter(folder, crc=True, sha256=signing_key is not None)
        dcp.save({"model": state_dict}, storage_writer=writer, no_dist=True)
        with writer.fs.create_stream(folder / "config.toml", "wb") as file:
            file.write(to_toml(config).encode("utf-8"))
        write_manifest(folder, "write", writer.fs.records, signing_key, step=folder_step(step_dir))

    write_whole(step_dir, write)
    logger.info(f"Wrote the model-only checkpoint {step_dir} from {hf_dir}: {report.describe()}")


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
    """The model args every entry point derives from `config` (`torchpre.assembly.args.model_args`)."""
    spec = get_model_spec(config.model.name)
    if spec.hf is None:
        raise TorchpreError(
            f"model.name = '{config.model.name}' has no Hugging Face conversion: its ModelSpec has no `hf` adapter."
        )
    tokenizer = job_tokenizer(config)
    args = model_args(config, tokenizer)
    check_hf_mlp(args, "python -m torchpre.convert")
    return _Model(args, spec.hf, model_context(config, tokenizer), tokenizer)


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
    metadata = read_metadata(step_dir, loader.check.whole_folder_checked(), loader.allow_pickle)
    state_dict = {
        key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if not state_dict:
        raise TorchpreError(f"Checkpoint {step_dir} holds no 'model' tensors.")
    loader.load({"model": state_dict}, no_dist=True)
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
    """Before any work: the output folder must not exist or be empty (stale files would mix in), and must not be a
    symbolic link (the output would land wherever it leads)."""
    if target.is_symlink():
        raise UntrustedInput(
            f"Output {target} is a symbolic link; convert writes a folder of its own there and never writes through a "
            "link. Give the real path, or another one."
        )
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise TorchpreError(f"Output {target} already exists and is not an empty folder; remove it or choose another.")


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog=USAGE)
