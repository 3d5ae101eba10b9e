"""Generation: the KV cache against a full forward, sampling, and `-m torchpre.generate` on a
checkpoint under 1 process, tp2 and pp2 (same greedy tokens), plus its bad-input errors."""

import dataclasses
import json
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from tests.launch import add_manifest, run_entry
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, load_tokenizer
from torchpre.errors import TorchpreError
from torchpre.generate import generate_ids, main, sample, whole_model
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.parallel.pipeline import prune_to

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog. " * 20
PROMPT = "The quick brown"
NEW_TOKENS = 12
# fp32 on CPU: cached decoding computes the same sums as the full forward, over the same keys,
# only through other kernels (explicit mask, shorter query block): reduction-order noise ~1e-6.
CACHE_TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two threads on two cores shared with the torchrun workers of these tests (and other jobs)
    are many times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def trained(tokenizer, tmp_path_factory) -> tuple[Transformer, Path]:
    """The tiny flavor after 30 Adam steps on a repeated sentence (so greedy decoding continues it),
    saved as `{dump}/checkpoint/step-5` the way the trainer names it. Returns (model, dump folder)."""
    args = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=tokenizer.vocab_size, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    ids = torch.tensor([tokenizer.encode(TEXT, bos=True, eos=False)[:64]])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dump = tmp_path_factory.mktemp("generate")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=dump / "checkpoint" / "step-5", no_dist=True)
    add_manifest(dump / "checkpoint" / "step-5")
    return model.eval(), dump


def reference_ids(model: Transformer, tokenizer: Tokenizer, **sampling) -> list[int]:
    prompt = tokenizer.encode(PROMPT, bos=True, eos=False)
    return generate_ids(whole_model(model), prompt, NEW_TOKENS, eos_id=tokenizer.eos_id, **sampling)


# KV cache ----------------------------------------------------------------------------------------


@torch.no_grad()
def test_cached_decoding_matches_the_full_forward(trained):
    """Prefill 5 positions, then 3 at once (mask over cached + new), then one at a time."""
    model, _ = trained
    tokens = torch.randint(0, model.args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    full = model(tokens)
    model.setup_caches(batch_size=2, max_len=20)
    chunks = [(0, 5), (5, 8), *((p, p + 1) for p in range(8, 20))]
    cached = torch.cat([model(tokens[:, a:b], start_pos=a) for a, b in chunks], dim=1)
    model.clear_caches()
    torch.testing.assert_close(cached, full, rtol=0, atol=CACHE_TOLERANCE)
    assert torch.equal(model(tokens), full)  # training forward untouched by the cache


@torch.no_grad()
def test_pipeline_stages_decode_with_their_own_caches(trained):
    model, _ = trained
    first, last = prune_to(model, ["tok_embeddings", "layers.0"]), prune_to(model, ["layers.1", "norm", "output"])
    tokens = torch.randint(0, model.args.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    full = model(tokens)
    for stage in (first, last):
        stage.setup_caches(batch_size=1, max_len=10)
    cached = torch.cat([last(first(tokens[:, p : p + 1], start_pos=p), start_pos=p) for p in range(10)], dim=1)
    torch.testing.assert_close(cached, full, rtol=0, atol=CACHE_TOLERANCE)


# Sampling ----------------------------------------------------------------------------------------


def test_greedy_continues_the_training_text(trained, tokenizer):
    ids = reference_ids(trained[0], tokenizer, temperature=0, top_k=None, seed=0)
    assert len(ids) == NEW_TOKENS
    assert tokenizer.decode(ids).startswith(" fox jumps over the")


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(trained, tokenizer):
    model = trained[0]
    hot = dict(temperature=3.0, top_k=None)
    first, again = (reference_ids(model, tokenizer, **hot, seed=1) for _ in range(2))
    assert first == again
    assert reference_ids(model, tokenizer, **hot, seed=2) != first
    greedy = reference_ids(model, tokenizer, temperature=0, top_k=None, seed=0)
    assert reference_ids(model, tokenizer, temperature=3.0, top_k=1, seed=1) == greedy


def test_top_k_samples_only_the_k_most_likely():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    top = set(torch.topk(logits, 3).indices.tolist())
    generator = torch.Generator().manual_seed(0)
    draws = {sample(logits, 1.0, 3, generator) for _ in range(200)}
    assert draws == top


# The command --------------------------------------------------------------------------------------


def run_generate(dump: Path, nproc: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    argv = [
        "--model.flavor",
        "tiny",
        "--job.dump_folder",
        str(dump),
        "--prompt",
        PROMPT,
        "--max_new_tokens",
        str(NEW_TOKENS),
        *args,
    ]
    return run_entry("torchpre.generate", argv, nproc, timeout)


def generated(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, f"generate failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    (line,) = result.stdout.strip().splitlines()  # --json prints exactly one line on stdout
    return json.loads(line)


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (1, []),
        (2, ["--parallelism.tensor_parallel_degree", "2"]),
        (2, ["--parallelism.pipeline_parallel_degree", "2"]),
        (2, []),  # docs/generation.md's command: two data-parallel replicas decode the same sequence
        (4, ["--parallelism.pipeline_parallel_degree", "2"]),  # two replicas of a two-stage pipeline
    ],
    ids=["1proc", "tp2", "pp2", "dp2", "dp2xpp2"],
)
def test_greedy_tokens_do_not_depend_on_the_layout(trained, tokenizer, nproc, layout):
    model, dump = trained
    record = generated(run_generate(dump, nproc, "--temperature", "0", "--json", *layout))
    expected = reference_ids(model, tokenizer, temperature=0, top_k=None, seed=0)
    assert record["token_ids"] == expected
    assert record["prompt"] == PROMPT
    assert record["prompt_token_ids"] == tokenizer.encode(PROMPT, bos=True, eos=False)
    assert record["completion"] == tokenizer.decode(expected)


def test_tensor_parallel_ranks_sample_the_same_tokens(trained, tokenizer):
    """Each TP rank samples from the same gathered logits with the same seeded generator; a rank
    that drew another token would feed the next all-reduce a different input and change rank 0's."""
    model, dump = trained
    sampling = ["--temperature", "3", "--top_k", "50", "--seed", "3", "--json"]
    record = generated(run_generate(dump, 2, *sampling, "--parallelism.tensor_parallel_degree", "2"))
    expected = reference_ids(model, tokenizer, temperature=3.0, top_k=50, seed=3)
    assert expected != reference_ids(model, tokenizer, temperature=0, top_k=None, seed=0)  # really sampled
    assert record["token_ids"] == expected


def test_a_corrupt_latest_checkpoint_falls_back_to_the_one_before(trained, tokenizer, tmp_path):
    """As training resumes: the newest step fails its manifest, so generation warns and loads the previous."""
    model, dump = trained
    shutil.copytree(dump / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    newest = shutil.copytree(dump / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-6")
    (newest / "__0_0.distcp").write_bytes(b"truncated")
    result = run_generate(tmp_path, 1, "--temperature", "0", "--json")
    assert f"checkpoint {newest} is corrupt: {newest / '__0_0.distcp'} has 9 bytes" in result.stderr
    expected = reference_ids(model, tokenizer, temperature=0, top_k=None, seed=0)
    assert generated(result)["token_ids"] == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint.folder", "no_such_folder"], "no_such_folder does not exist"),
        (["--checkpoint.load_step", "7"], "complete steps: 5"),
        (["--prompt", ""], "--prompt is empty"),
        (["--max_new_tokens", "0"], "--max_new_tokens = 0"),
    ],
)
def test_bad_input_is_a_clear_error(trained, args, message):
    dump = trained[1]
    argv = ["--model.flavor", "tiny", "--job.dump_folder", str(dump), "--prompt", PROMPT, *args]
    with pytest.raises(TorchpreError, match=message):
        main(argv)


def test_missing_checkpoint_exits_2_with_one_message(tmp_path):
    result = run_generate(tmp_path, 1, "--checkpoint.folder", str(tmp_path / "nothing"), timeout=60)
    assert result.returncode == 2
    assert f"{tmp_path / 'nothing'} does not exist" in result.stderr
    assert "Traceback" not in result.stderr
