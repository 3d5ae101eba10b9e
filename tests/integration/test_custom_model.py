"""A model torchpre has never seen, defined only here, trained through the public API under every layout.

`GPT2` is a GPT-2-style decoder (LayerNorm, learned position embeddings, GELU MLP, biases, tied
embeddings). Run as a script, this file registers it as `model.name = "gpt2-test"` and runs train.py's
main (or torchpre.generate's), exactly as a user's own launcher would.
"""

import dataclasses
import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.launch import REPO, run_train, train_and_read_metrics  # noqa: E402
from torchpre.errors import ConfigError  # noqa: E402
from torchpre.models.init import ParamInit, init_parameters, ones  # noqa: E402
from torchpre.models.registry import HFAdapter, ModelSpec, register_model  # noqa: E402
from torchpre.parallel import ParallelPlan, parallelize  # noqa: E402

THIS_FILE = Path(__file__).relative_to(REPO)


@dataclasses.dataclass(frozen=True)
class GPT2Args:
    """`vocab_size` and `max_seq_len` are set by torchpre (tokenizer, sequence length); the learned position
    table has its own fixed size, `n_positions`, so checkpoints fit whatever the sequence length."""

    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_positions: int = 64
    vocab_size: int = 2048
    max_seq_len: int = 64


class SelfAttention(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.q, self.k, self.v = (nn.Linear(args.dim, args.dim) for _ in range(3))
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds some of them.
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.fc, self.proj = nn.Linear(args.dim, 4 * args.dim), nn.Linear(4 * args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(args.dim), SelfAttention(args)
        self.ln_2, self.mlp = nn.LayerNorm(args.dim), MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Pipeline-ready: a stage without `wte` takes hidden states, one without `lm_head` returns them."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.n_positions, args.dim)
        self.h = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.wte(tokens) + self.wpe(positions)
        else:
            h = tokens
        for block in self.h.values():
            h = block(h)
        return self.lm_head(self.ln_f(h)) if self.lm_head is not None else h

    def init_weights(self, seed: int) -> None:
        init_parameters(self, seed, gpt2_init_rule(self.args))


def zeros(tensor: torch.Tensor, *, generator: torch.Generator) -> None:
    tensor.zero_()


def gpt2_init_rule(args: GPT2Args):
    def rule(fqn: str) -> ParamInit:
        if fqn in ("wte.weight", "lm_head.weight"):  # tied: one key, so both copies start equal
            return ParamInit("wte.weight", functools.partial(nn.init.normal_, std=0.02))
        if fqn.endswith("bias"):
            return ParamInit(fqn, zeros)
        if ".ln_" in fqn or fqn.startswith("ln_f"):
            return ParamInit(fqn, ones)
        std = 0.02 / math.sqrt(2 * args.n_layers) if fqn.endswith("proj.weight") else 0.02
        return ParamInit(fqn, functools.partial(nn.init.normal_, std=std))

    return rule


TP_PLAN = {
    "h.*.attn.q": ColwiseParallel(),
    "h.*.attn.k": ColwiseParallel(),
    "h.*.attn.v": ColwiseParallel(),
    "h.*.attn.proj": RowwiseParallel(),
    "h.*.mlp.fc": ColwiseParallel(),
    "h.*.mlp.proj": RowwiseParallel(),
}

def to_hf(state_dict: dict[str, torch.Tensor], args: GPT2Args) -> dict[str, torch.Tensor]:
    """-> transformers' GPT2LMHeadModel names: fused qkv, Conv1D weights stored [in, out], lm_head tied."""
    hf = {f"transformer.{name}": state_dict[name] for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    for i in range(args.n_layers):
        ours, theirs = f"h.{i}", f"transformer.h.{i}"
        for kind in ("weight", "bias"):
            for norm in ("ln_1", "ln_2"):
                hf[f"{theirs}.{norm}.{kind}"] = state_dict[f"{ours}.{norm}.{kind}"]
            qkv = torch.cat([state_dict[f"{ours}.attn.{p}.{kind}"] for p in "qkv"])
            pairs = [
                ("attn.c_attn", qkv),
                ("attn.c_proj", state_dict[f"{ours}.attn.proj.{kind}"]),
                ("mlp.c_fc", state_dict[f"{ours}.mlp.fc.{kind}"]),
                ("mlp.c_proj", state_dict[f"{ours}.mlp.proj.{kind}"]),
            ]
            for name, tensor in pairs:
                hf[f"{theirs}.{name}.{kind}"] = tensor.t().contiguous() if kind == "weight" else tensor
    return hf


def hf_config(args: GPT2Args, *, bos_token_id: int, eos_token_id: int, torch_dtype: str, max_position_embeddings: int):
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": args.dim, "n_layer": args.n_layers,
        "n_head": args.n_heads, "n_positions": args.n_positions, "vocab_size": args.vocab_size,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": torch_dtype,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }


def unsupported(*args):
    raise NotImplementedError("this test model converts to Hugging Face only")


SPEC = ModelSpec(
    model_cls=GPT2,
    flavors={"tiny": GPT2Args()},
    blocks="h",
    tensor_parallel=TP_PLAN,
    tied_weights=lambda args: ("wte.weight", "lm_head.weight"),
    hf=HFAdapter(to_hf_state_dict=to_hf, from_hf_state_dict=unsupported, hf_config=hf_config,
                 hf_config_mismatches=unsupported),
)

ARGS = [
    "--model.name", "gpt2-test",
    "--model.flavor", "tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "4",
    "--training.global_batch_size", "8",
    "--training.steps", "8",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.lr", "3e-3",
    "--metrics.log_freq", "1",
]
# fp32 on CPU; layouts differ only in reduction order (see test_train.py for the argument).
LOSS_TOLERANCE = 1e-4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    folder = tmp_path_factory.mktemp("gpt2-reference")
    records = train_and_read_metrics(ARGS, 1, folder, script=str(THIS_FILE))
    return [r["loss"] for r in records]


def test_the_model_learns(reference):
    assert reference[0] == pytest.approx(math.log(2048), abs=0.05)
    assert reference[-1] < reference[0] - 0.1


@pytest.mark.parametrize(
    "layout, nproc",
    [
        (["--parallelism.tensor_parallel_degree", "2"], 2),
        (["--parallelism.pipeline_parallel_degree", "2"], 2),
        (["--parallelism.tensor_parallel_degree", "2", "--optimizer.zero_stage", "1"], 4),
    ],
    ids=["tp2", "pp2", "dp2xtp2-zero1"],
)
def test_layout_matches_one_process(reference, layout, nproc, tmp_path):
    records = train_and_read_metrics([*ARGS, *layout], nproc, tmp_path, script=str(THIS_FILE))
    assert [r["loss"] for r in records] == pytest.approx(reference, abs=LOSS_TOLERANCE)


def test_checkpoint_resumes_and_generates_under_another_layout(reference, tmp_path):
    """Saved under pp2 at step 4, resumed single-process to step 8: the losses continue the reference; then
    the checkpoint generates text (no KV cache: the model recomputes the sequence) under tp2 and converts to a
    Hugging Face GPT-2 that transformers runs to the same logits."""
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "4"]
    first = [*ARGS, *checkpoint, "--training.steps", "8", "--parallelism.pipeline_parallel_degree", "2"]
    result = run_train([*first, "--checkpoint.keep_latest_k", "0"], 2, tmp_path, script=str(THIS_FILE))
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp_path / "checkpoint" / "step-8").rename(tmp_path / "step-8-done")
    (tmp_path / "metrics.jsonl").unlink()
    records = train_and_read_metrics([*ARGS, *checkpoint], 1, tmp_path, script=str(THIS_FILE))
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert [r["loss"] for r in records] == pytest.approx(reference[4:], abs=LOSS_TOLERANCE)

    generate = ["generate", *ARGS, "--parallelism.tensor_parallel_degree", "2", "--prompt", "Once upon a time",
                "--max_new_tokens", "5", "--temperature", "0", "--json"]
    result = run_train(generate, 2, tmp_path, script=str(THIS_FILE))
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]) == 5

    # Converted to a Hugging Face GPT-2 folder, the weights give transformers the logits they give torchpre.
    hf_dir = tmp_path / "hf"
    command = [sys.executable, str(THIS_FILE), "convert", "dcp-to-hf", str(tmp_path / "checkpoint" / "step-8"),
               str(hf_dir), *ARGS]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    transformers = pytest.importorskip("transformers")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ours = GPT2(GPT2Args(vocab_size=theirs.config.vocab_size))
    weights = {name: torch.empty_like(tensor) for name, tensor in ours.state_dict().items()}
    dcp.load({"model": weights}, checkpoint_id=tmp_path / "checkpoint" / "step-8", no_dist=True)
    ours.load_state_dict(weights)
    tokens = torch.randint(0, theirs.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # fp32, the same operations in another order: 1e-5 is rounding
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_a_plan_naming_a_missing_module_is_a_clear_error():
    with torch.device("meta"):
        model = GPT2(GPT2Args())
    plan = ParallelPlan(tensor_parallel={**TP_PLAN, "h.*.mlp.c_fc": ColwiseParallel()}, blocks="h")
    message = r"plan key 'h\.\*\.mlp\.c_fc'.*'h\.0\.mlp\.c_fc' is not a submodule.*mlp\.fc"
    with pytest.raises(ConfigError, match=message):
        parallelize(model, None, plan, device=torch.device("cpu"), init_weights=lambda m: None)


if __name__ == "__main__":
    from torchpre.cli import run_entry_point

    register_model("gpt2-test", SPEC)
    argv = sys.argv[1:]
    if argv[:1] == ["convert"]:  # `... test_custom_model.py convert dcp-to-hf SRC DST [options]`
        from torchpre.convert import main as entry_point

        argv = argv[1:]
    elif "generate" in argv:  # `... test_custom_model.py [options] generate [options]` runs torchpre.generate
        from torchpre.generate import main as entry_point

        argv.remove("generate")
    else:
        from train import main as entry_point
    run_entry_point(entry_point, argv, prog=str(THIS_FILE))
