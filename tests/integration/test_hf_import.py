"""`checkpoint.initial_load_path` = a Hugging Face folder: released weights loaded straight into the sharded model.

Each folder is made here by transformers' `save_pretrained` (random weights, fp32, several safetensors files and an
index), then trained for one step with `--model.flavor from_hf` under a layout, each rank reading the shards it
holds. Two numbers per case:
- the first step's loss equals transformers' loss on the same global batch (the one-process data order, which every
  layout shares) within 1e-5: the step's forward runs on the loaded weights, and both models compute the same mean
  token cross-entropy in fp32 on CPU, in another order (measured below 1e-6);
- every rank's state after the load, gathered to whole tensors, equals what `hf-to-dcp` writes, bitwise.
CI runs a sample that covers every layout of several ranks once; the other rows are `-m parity_matrix`.
"""

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.integration.test_hf_convert import quantize_fp8_blocks
from tests.launch import read_checkpoint, run_train
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args, to_toml
from torchpre.convert import main as convert_main
from torchpre.data.loader import build_dataloader
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

SEQ_LEN, GLOBAL_BATCH, SEED = 32, 8, 42
LOSS_ATOL = 1e-5
VOCAB = load_tokenizer(DEFAULT_TOKENIZER_PATH).vocab_size

# Llama 3.1 scaling on (over 16 positions, so that it changes most frequencies within 32), untied.
LLAMA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
    initializer_range=0.1,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
)  # fmt: skip
# Every released DeepSeek-V3 feature on a tiny shape: query latent, YaRN with mscale, group-limited routing, a shared
# expert, a dense first block; rms_norm_eps 1e-5 (the latent norms stay at 1e-6, as transformers' do).
DEEPSEEK_V3 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    v_head_dim=16, qk_nope_head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, routed_scaling_factor=2.5,
    initializer_range=0.1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                     "mscale": 1.0, "mscale_all_dim": 0.7},
)  # fmt: skip
# model.name = 'hf' (transformers' own model): Qwen2, with q/k/v biases and tied embeddings.
QWEN2 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, initializer_range=0.1,
)  # fmt: skip
FAMILIES = {
    "llama3": (transformers.LlamaConfig, LLAMA),
    "deepseek_v3": (transformers.DeepseekV3Config, DEEPSEEK_V3),
    # Tied as transformers saves it: no lm_head.weight in the folder.
    "deepseek_v3_tied": (transformers.DeepseekV3Config, DEEPSEEK_V3 | {"tie_word_embeddings": True}),
    "hf": (transformers.Qwen2Config, QWEN2),
}

TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
MATRIX = pytest.mark.parity_matrix
LAYOUTS = {
    "1proc": (1, []),
    "dp2_zero3": (2, ["--optimizer.zero_stage", "3"]),
    "tp2": (2, TP2),
    "pp2": (2, PP2),
    "ep2": (2, ["--parallelism.expert_parallel_degree", "2"]),
}
# Every layout once in CI; the rest with -m parity_matrix.
# The one-process load is also each family's in tests/unit/test_hf_folder_parity.py.
CI = {("llama3", "dp2_zero3"), ("llama3", "pp2"), ("deepseek_v3", "ep2"), ("hf", "tp2"), ("deepseek_v3_tied", "1proc"),
      ("deepseek_v3_tied", "tp2"), ("deepseek_v3_tied", "pp2")}  # fmt: skip
CASES = [
    pytest.param(family, layout, id=f"{family}-{layout}", marks=[] if (family, layout) in CI else [MATRIX])
    for family in FAMILIES
    for layout in LAYOUTS
    if layout != "ep2" or family == "deepseek_v3"
]


def save_released(config: "transformers.PretrainedConfig", folder: Path) -> "transformers.PreTrainedModel":
    """A random model saved as released folders are: several safetensors files and an index; norms and routing
    biases away from their initial 1 and 0, as a trained model's are."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", "layernorm.weight")):
                tensor.copy_(1 + 0.1 * torch.randn_like(tensor))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn_like(tensor))
    model.save_pretrained(folder, max_shard_size="150KB")
    return model


def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The first global batch of the job's data (the built-in corpus, the seed's order), as one process reads it."""
    loader = build_dataloader(
        dataset="stdlib", dataset_path="", tokenizer=load_tokenizer(DEFAULT_TOKENIZER_PATH), seq_len=SEQ_LEN,
        local_batch_size=GLOBAL_BATCH, global_batch_size=GLOBAL_BATCH, dp_rank=0, dp_size=1, seed=SEED,
        vocab_size=VOCAB,
    )  # fmt: skip
    return next(iter(loader))


def job_args(family: str, folder: Path) -> list[str]:
    model = ["--model.hf_config", str(folder)] if family == "hf" else ["--model.flavor", "from_hf"]
    return [
        "--model.name", family.removesuffix("_tied"), *model, "--checkpoint.initial_load_path", str(folder),
        "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", "4",
        "--training.global_batch_size", str(GLOBAL_BATCH), "--training.steps", "1", "--metrics.log_freq", "1",
    ]  # fmt: skip


@dataclass(frozen=True)
class Released:
    folder: Path
    loss: float  # transformers' on the first global batch
    state: dict[str, torch.Tensor]  # what hf-to-dcp writes


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Callable[[str], Released]:
    """Each family's folder, made once when a test first asks for it."""
    made: dict[str, Released] = {}

    def get(family: str) -> Released:
        if family not in made:
            made[family] = release(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


def release(family: str, root: Path) -> Released:
    config_class, fields = FAMILIES[family]
    model = save_released(config_class(**fields), root / "hf")
    assert len(list((root / "hf").glob("model-*.safetensors"))) > 2
    index = json.loads((root / "hf" / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) != fields.get("tie_word_embeddings", False)
    inputs, labels = first_batch()
    with torch.no_grad():
        loss = F.cross_entropy(model(inputs).logits.flatten(0, 1), labels.flatten()).item()
    job = root / "job.toml"
    job.write_text(to_toml(parse_args(JobConfig, job_args(family, root / "hf"))))
    convert_main(["hf-to-dcp", str(root / "hf"), str(root / "dcp" / "step-0"), "--job.config_file", str(job)])
    return Released(root / "hf", loss, read_checkpoint(root / "dcp" / "step-0")["model"])


@pytest.mark.parametrize("family, layout", CASES)
def test_a_released_folder_loads_under_every_layout_as_transformers_and_hf_to_dcp_have_it(
    released, family, layout, tmp_path
):
    folder = released(family)
    nproc, extra = LAYOUTS[layout]
    result = run_train([*job_args(family, folder.folder), *extra], nproc, tmp_path, script="tests/hf_import_worker.py")
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    loss = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(loss - folder.loss) <= LOSS_ATOL, (loss, folder.loss)
    for rank in range(nproc):
        state = load_file(tmp_path / f"state_rank{rank}.safetensors")
        assert state, f"rank {rank} holds nothing"
        for name, tensor in state.items():
            assert torch.equal(tensor, folder.state[name]), f"rank {rank}: {name}"


@pytest.mark.parametrize("layout", ["tp2", pytest.param("dp2_zero3", marks=MATRIX)])
def test_a_block_fp8_folder_loads_sharded_as_hf_to_dcp_dequantizes_it(released, layout, tmp_path):
    """DeepSeek-V3's released block FP8, in 10 x 10 blocks so that shards start and end inside blocks: each rank
    dequantizes the boxes it holds, bitwise what hf-to-dcp makes of the whole weights (bf16, here upcast to the
    fp32 the job trains in)."""
    source = released("deepseek_v3").folder
    folder = tmp_path / "fp8"
    quantized = quantize_folder(source, folder, block=10)
    assert quantized == 8 + 2 * (5 + 8 * 3 + 3)  # the dense block's projections, each MoE block's and its experts'
    job = tmp_path / "job.toml"
    job.write_text(to_toml(parse_args(JobConfig, job_args("deepseek_v3", folder))))
    convert_main(["hf-to-dcp", str(folder), str(tmp_path / "dcp" / "step-0"), "--job.config_file", str(job)])
    reference = read_checkpoint(tmp_path / "dcp" / "step-0")["model"]
    assert reference["layers.1.attention.wkv_b.weight"].dtype == torch.bfloat16
    nproc, extra = LAYOUTS[layout]
    dump = tmp_path / "run"
    result = run_train([*job_args("deepseek_v3", folder), *extra], nproc, dump, script="tests/hf_import_worker.py")
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    for rank in range(nproc):
        for name, tensor in load_file(dump / f"state_rank{rank}.safetensors").items():
            assert torch.equal(tensor, reference[name].float()), f"rank {rank}: {name}"


def quantize_folder(source: Path, folder: Path, block: int) -> int:
    """A copy of `source` with every linear weight of the blocks in float8_e4m3fn and a float32 scale per block x
    block tile, as DeepSeek-V3 is released; returns how many weights it quantized."""
    folder.mkdir()
    index = json.loads((source / "model.safetensors.index.json").read_text())
    count = 0
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(source / file)
        linear = [n for n in tensors if n.startswith("model.layers.") and n.endswith(("proj.weight", "_mqa.weight"))]
        for name in linear:
            tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8_blocks(tensors[name], block)
            index["weight_map"][f"{name}_scale_inv"] = file
            count += 1
        save_file(tensors, folder / file, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block], "fmt": "e4m3"}
    (folder / "config.json").write_text(json.dumps(config))
    return count


@pytest.mark.parametrize("layout", ["1proc", "tp2", "pp2"])
def test_a_tied_deepseek_v3_config_beside_an_lm_head_of_its_own_is_refused_on_every_layout(released, layout, tmp_path):
    """tie_word_embeddings in config.json beside an lm_head.weight that differs from the embedding: refused by name
    under every layout, as the llama3 reader refuses it, where one layout would ignore lm_head.weight and another
    (a pipeline's last stage) train it."""
    folder = shutil.copytree(released("deepseek_v3").folder, tmp_path / "tied")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    nproc, extra = LAYOUTS[layout]
    result = run_train([*job_args("deepseek_v3", folder), *extra], nproc, tmp_path / "run")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "lm_head.weight" in result.stderr and "ties them (tie_word_embeddings)" in result.stderr, result.stderr
