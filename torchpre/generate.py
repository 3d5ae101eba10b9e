"""Text generation from a training checkpoint, under any tensor/pipeline-parallel layout.

    torchrun --nproc_per_node=N -m torchpre.generate --job.config_file X.toml \\
        --checkpoint.folder DIR [--checkpoint.load_step S] --prompt "..." \\
        [--max_new_tokens K --temperature T --top_k K --seed S] [--json]

The model is built for this layout exactly as the trainer builds it (meta device, TP plan,
pipeline stage), and DCP reshards the checkpoint into it. Decoding uses the model's KV caches:
one forward over the prompt, then one token at a time. Under pipeline parallelism each stage
runs its layers and sends the hidden states to the next with point-to-point sends; the last
stage samples and broadcasts the token to every stage. Tensor-parallel ranks see the same full
logits and sample with identically seeded generators, so they agree without communicating. Ranks
left over by tp x pp (data-parallel replicas, e.g. `--nproc_per_node=2` with no TP/PP) each decode the
same sequence on their own pipeline; rank 0 prints it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from torchpre.checkpoint.manager import (
    STEP_DIR,
    check_shapes,
    checkpoint_metadata,
    find_intact_step,
    find_step_dir,
    require_intact,
)
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.custom_import import import_custom_module
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.distributed.utils import init_distributed, select_device, world_size_from_env
from torchpre.errors import ConfigError, TorchpreError
from torchpre.models.registry import get_flavor, get_model_spec
from torchpre.parallel.api import apply_tensor_parallel_plan, retie
from torchpre.parallel.pipeline import prune_to

GENERATION_HELP = """\
Generation options (besides the job options below, of which generation reads job.*, model.*,
training.mixed_precision_param, parallelism.tensor_parallel_degree, parallelism.pipeline_parallel_degree,
parallelism.pipeline_parallel_split_points, checkpoint.folder and checkpoint.load_step):
  --prompt TEXT           text to continue (required)
  --max_new_tokens INT    most tokens to generate; stops earlier at the end-of-text token (default 32)
  --temperature FLOAT     softmax temperature; 0 = greedy (default 0.8)
  --top_k INT             sample among the k most likely tokens only (default: all)
  --seed INT              seed of the sampling generator, the same on every rank (default 0)
  --json                  print one JSON line {"prompt", "prompt_token_ids", "completion", "token_ids"}
"""


@dataclasses.dataclass(frozen=True)
class GenerationArgs:
    prompt: str | None = None
    max_new_tokens: int = 32
    temperature: float = 0.8
    top_k: int | None = None
    seed: int = 0
    json: bool = False


_VALUE_FLAGS = {"prompt": str, "max_new_tokens": int, "temperature": float, "top_k": int, "seed": int}


def parse_generation_args(argv: Sequence[str]) -> tuple[GenerationArgs, list[str]]:
    """Takes the generation flags out of `argv`; returns them and the rest (the job's options)."""
    values: dict[str, object] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name == "json":
            values["json"] = True if not eq else _parse_bool(inline)
        elif name in _VALUE_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"--{name} needs a value.")
                i += 1
                inline = argv[i]
            values[name] = _parse_value(name, inline)
        else:
            rest.append(arg)
        i += 1
    return GenerationArgs(**values), rest


def _parse_value(name: str, text: str) -> object:
    if name == "top_k" and text.lower() == "none":
        return None
    try:
        return _VALUE_FLAGS[name](text)
    except ValueError:
        raise ConfigError(f"--{name} = {text!r} is not a valid {_VALUE_FLAGS[name].__name__}.") from None


def _parse_bool(text: str) -> bool:
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.lower() not in words:
        raise ConfigError(f"--json = {text!r}: use true or false (or a bare --json).")
    return words[text.lower()]


def validate_generation_args(gen: GenerationArgs) -> None:
    if gen.prompt is None:
        raise ConfigError('--prompt is required: the text to continue, e.g. --prompt "def main():"')
    if not gen.prompt:
        raise ConfigError("--prompt is empty: give some text to continue.")
    if gen.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens = {gen.max_new_tokens}: it must be at least 1.")
    if gen.temperature < 0:
        raise ConfigError(f"--temperature = {gen.temperature}: use 0 for greedy decoding or a positive value.")
    if gen.top_k is not None and gen.top_k < 1:
        raise ConfigError(f"--top_k = {gen.top_k}: it must be at least 1 (or none for no top-k filtering).")


# Checkpoint ------------------------------------------------------------------------------------


def checkpoint_folder(dump_folder: str, folder: str) -> Path:
    """`folder` itself when absolute or existing, else `{dump_folder}/{folder}` (as the trainer saves)."""
    path = Path(folder)
    return path if path.is_absolute() or path.exists() else Path(dump_folder) / folder


def find_generation_step(folder: Path, load_step: int) -> Path:
    """The complete `step-N` folder to load: `load_step`, or the highest one for -1.

    `folder` may also be a `step-N` folder itself (with load_step -1 or N).
    """
    if STEP_DIR.match(folder.name) and (folder / ".metadata").is_file():
        if load_step in (-1, int(folder.name[5:])):
            return folder
    if not folder.is_dir():
        raise TorchpreError(
            f"The checkpoint folder {folder} does not exist. Set --checkpoint.folder to the folder holding "
            "the step-N checkpoints (absolute, or relative to job.dump_folder as in training)."
        )
    step_dir = find_step_dir(folder, load_step)
    if step_dir is None:
        raise TorchpreError(
            f"The checkpoint folder {folder} holds no complete step-N checkpoint. Point --checkpoint.folder "
            "at a training run's checkpoint folder."
        )
    return step_dir


def check_checkpoint_fits(model: nn.Module, step_dir: Path) -> None:
    """Names the model weights the checkpoint lacks or holds with another shape (global shapes)."""
    check_shapes({"model": model.state_dict()}, checkpoint_metadata(step_dir), step_dir)


# Decoding --------------------------------------------------------------------------------------


def sample(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """A token id from logits [vocab]: greedy for temperature 0, else softmax(logits / temperature)
    over the top_k most likely tokens (all when None), drawn from `generator` (a CPU generator)."""
    logits = logits.float().cpu()
    if temperature == 0:
        return int(logits.argmax())
    if top_k is not None and top_k < logits.numel():
        values, indices = torch.topk(logits, top_k)
    else:
        values, indices = logits, None
    probs = torch.softmax(values / temperature, dim=-1)
    choice = int(torch.multinomial(probs, 1, generator=generator))
    return choice if indices is None else int(indices[choice])


class StageDecoder:
    """Runs this rank's model (or pipeline stage) one decoding step at a time.

    Without `pp_group` the model is whole. With it, stage r receives the hidden states
    [batch, seq, dim] from stage r - 1 and sends its own to r + 1, and the token sampled by the
    last stage is broadcast to all stages.
    """

    def __init__(self, model: nn.Module, hidden_dim: int, pp_group: dist.ProcessGroup | None = None) -> None:
        self.model = model
        self.hidden_dim = hidden_dim
        self.group = pp_group
        self.rank = dist.get_rank(pp_group) if pp_group is not None else 0
        self.size = dist.get_world_size(pp_group) if pp_group is not None else 1
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # Models without KV caches (`setup_caches`) recompute the whole sequence for every new token.
        self.cached = hasattr(model, "setup_caches")

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def logits(self, tokens: Tensor, start_pos: int) -> Tensor | None:
        """Logits [vocab] after the last of `tokens` [1, seq] (positions start_pos..), on the last
        stage; None on the others. Every stage is given the tokens (it needs their shape)."""
        if self.rank == 0:
            x = tokens
        else:
            x = torch.empty(*tokens.shape, self.hidden_dim, dtype=self.dtype, device=self.device)
            dist.recv(x, group=self.group, group_src=self.rank - 1)
        h = self.model(x, start_pos=start_pos) if self.cached else self.model(x)
        if not self.is_last:
            dist.send(h.contiguous(), group=self.group, group_dst=self.rank + 1)
            return None
        return h[0, -1]

    def share(self, token: int | None) -> int:
        """The last stage's token, on every stage."""
        if self.size == 1:
            return token
        value = torch.tensor([-1 if token is None else token], dtype=torch.long, device=self.device)
        dist.broadcast(value, group=self.group, group_src=self.size - 1)
        return int(value.item())


@torch.no_grad()
def generate_ids(
    decoder: StageDecoder,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    seed: int,
    eos_id: int | None = None,
) -> list[int]:
    """The generated ids (without the prompt and without the end-of-text token that stops it).

    The model's KV caches must hold len(prompt_ids) + max_new_tokens positions; they are reset here.
    """
    if decoder.cached:
        decoder.model.setup_caches(1, len(prompt_ids) + max_new_tokens)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([list(prompt_ids)], dtype=torch.long, device=decoder.device)
    start_pos, generated = 0, []
    for _ in range(max_new_tokens):
        logits = decoder.logits(tokens, start_pos)
        token = decoder.share(None if logits is None else sample(logits, temperature, top_k, generator))
        if token == eos_id:
            break
        generated.append(token)
        new = torch.tensor([[token]], dtype=torch.long, device=decoder.device)
        if decoder.cached:
            start_pos += tokens.shape[1]
            tokens = new
        else:
            tokens = torch.cat([tokens, new], dim=1)
    if decoder.cached:
        decoder.model.clear_caches()
    return generated


# Entry point -----------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    # stdout carries the completion only; progress and warnings go to stderr.
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    gen, rest = parse_generation_args(argv)
    if "-h" in rest or "--help" in rest:
        print(GENERATION_HELP)
    config = parse_args(JobConfig, rest)
    import_custom_module(config.job.custom_import)
    validate_generation_args(gen)

    # Everything that can reject the input runs before the process group, identically on every rank.
    p = config.parallelism
    dims = ParallelDims.from_degrees(
        p.data_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree, world_size_from_env()
    )
    spec = get_model_spec(config.model.name)
    flavor = get_flavor(config.model.name, config.model.flavor)
    tokenizer = Tokenizer(config.model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
    prompt_ids = tokenizer.encode(gen.prompt, bos=True, eos=False)
    total = len(prompt_ids) + gen.max_new_tokens
    if total > flavor.max_seq_len:
        raise ConfigError(
            f"The prompt ({len(prompt_ids)} tokens) plus --max_new_tokens {gen.max_new_tokens} exceed the "
            f"model's context of {flavor.max_seq_len} tokens. Shorten the prompt or lower --max_new_tokens."
        )
    # RoPE is computed per position, so sizing it to this generation leaves the values unchanged.
    args = dataclasses.replace(flavor, vocab_size=tokenizer.vocab_size, max_seq_len=total)
    if dims.tp > 1 and spec.tensor_parallel is None:
        raise ConfigError(
            f"model.name = '{config.model.name}' has no tensor-parallel plan: use tensor_parallel_degree 1."
        )
    spec.validate_tensor_parallel(args, dims.tp)
    stages = spec.pipeline_stages(args, dims.pp, p.pipeline_parallel_split_points) if dims.pp > 1 else None
    folder, load_step = checkpoint_folder(config.job.dump_folder, config.checkpoint.folder), config.checkpoint.load_step
    step_dir = find_generation_step(folder, load_step)
    param_dtype = getattr(torch, config.training.mixed_precision_param)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(param_dtype)
    try:
        with torch.device("meta"):
            model = spec.model_cls(args)
    finally:
        torch.set_default_dtype(previous_dtype)
    check_checkpoint_fits(model, step_dir)

    device = select_device()
    init_distributed(device)
    mesh = dims.build_mesh(device.type)
    # The manifest check reads every file: the ranks share it, so it waits for the process group.
    if step_dir.parent == folder and load_step == -1:  # the latest: past corrupt ones, as training resumes
        step_dir = find_intact_step(folder, load_step)
        check_checkpoint_fits(model, step_dir)
    else:
        require_intact(step_dir, "checkpoint.folder" if load_step == -1 else f"checkpoint.load_step = {load_step}")
    pp_rank = mesh["pp"].get_local_rank()
    if stages is not None:
        model = prune_to(model, stages[pp_rank])
    if dims.tp > 1:
        plan = spec.tensor_parallel
        if callable(plan):
            plan = functools.partial(plan, sequence_parallel=False, loss_parallel=False)
        apply_tensor_parallel_plan(model, mesh["tp"], plan)
    model.to_empty(device=device)
    retie(model, spec.tied_weights(args))  # to_empty gives each module its own Parameter
    spec.init_weights(model, 0)  # buffers such as RoPE's; the checkpoint then replaces every parameter
    dcp.load({"model": model.state_dict()}, checkpoint_id=str(step_dir))
    model.eval()
    is_rank0 = dist.get_rank() == 0
    if is_rank0:
        replicas = (
            f"; the {dims.dp} data-parallel replicas each decode the same sequence (raise "
            "parallelism.tensor_parallel_degree to split the model instead)"
            if dims.dp > 1
            else ""
        )
        print(f"loaded {step_dir}; layout tp {dims.tp} x pp {dims.pp}{replicas}", file=sys.stderr, flush=True)

    decoder = StageDecoder(model, args.dim, mesh["pp"].get_group() if dims.pp > 1 else None)
    ids = generate_ids(
        decoder,
        prompt_ids,
        gen.max_new_tokens,
        temperature=gen.temperature,
        top_k=gen.top_k,
        seed=gen.seed,
        eos_id=tokenizer.eos_id,
    )
    if not is_rank0:
        return
    completion = tokenizer.decode(ids)
    if gen.json:
        record = {"prompt": gen.prompt, "prompt_token_ids": prompt_ids, "completion": completion, "token_ids": ids}
        print(json.dumps(record), flush=True)
    else:
        print(completion, flush=True)


if __name__ == "__main__":
    from torchpre.cli import run_entry_point

    run_entry_point(main, sys.argv[1:], prog="python -m torchpre.generate")
