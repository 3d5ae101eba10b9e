"""torchpre's view of transformers models: HFCausalLM runs a transformers model exactly as transformers does, with
every parameter and buffer initialised as transformers initialises it; pipeline stages and pruning keep
transformers' names, initialisation does not depend on the split, the parallelize API takes dotted paths and hands
loss functions the model's own output, and `model.hf_config` is checked with messages that name the key and the
file."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel

from tests.launch import REPO
from torchpre.config.job_config import JobConfig
from torchpre.errors import ConfigError, UntrustedInput
from torchpre.models.hf import HFArgs, HFCausalLM, decoder_stages, hf_args
from torchpre.models.hf.init import init_plan
from torchpre.models.hf.layouts import validate_tensor_parallel
from torchpre.models.hf.model import init_weights
from torchpre.models.hf.tiny import default_tiny_config
from torchpre.parallel import ParallelPlan, logits_of, parallelize, pipeline_stages
from torchpre.parallel.pipeline import prune_to

transformers = pytest.importorskip("transformers")

CONFIGS = {name: REPO / f"assets/hf_configs/{name}_tiny.json" for name in ("llama", "qwen2", "qwen3")}
VOCAB = 2048  # the shipped tokenizer's
# One architecture of each structure torchpre's support derives from modules: Llama's layout, Gemma's scaled
# embedding and (1 + weight) norms, GPT-2's Conv1D and position table, GPT-NeoX's fused q/k/v, Phi-3's fused
# projections, OLMo2's full-width q/k norms, Qwen2-MoE's experts. docs/hf-models.md covers every architecture.
ARCHITECTURES = ("gemma", "gemma2", "gemma3_text", "gpt2", "gpt_neox", "phi3", "olmo2", "qwen2_moe", "qwen3_moe")


def job(path: Path | str, **training) -> JobConfig:
    config = JobConfig()
    config.model = dataclasses.replace(config.model, name="hf", hf_config=str(path))
    config.training = dataclasses.replace(config.training, seq_len=32, **training)
    return config


def build(name: str, seed: int = 0) -> HFCausalLM:
    with torch.device("meta"):
        model = HFCausalLM(hf_args(job(CONFIGS[name]), VOCAB, 32))
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model


def tokens(batch: int = 2, seq: int = 16, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def tiny(model_type: str) -> HFArgs:
    config = default_tiny_config(model_type)
    config.use_cache = False
    return HFArgs(config=config, path=f"<tiny {model_type}>", max_seq_len=32)


def initialised(args: HFArgs, seed: int = 0) -> HFCausalLM:
    """HFCausalLM built on the meta device and initialised as the trainer does, every buffer first set to NaN so
    that one the initialisation misses shows in the logits."""
    with torch.device("meta"):
        model = HFCausalLM(args)
    model.to_empty(device="cpu")
    for buffer in model.buffers():
        if buffer.is_floating_point():
            buffer.fill_(float("nan"))
    init_weights(model, seed)
    return model


@pytest.mark.parametrize("args", [*CONFIGS, *ARCHITECTURES])
def test_hf_causal_lm_computes_what_transformers_computes(args):
    """The same parameters in transformers' own model give the same logits, bit for bit: HFCausalLM runs
    transformers' forward, and its buffers (rotary tables, Gemma's embedding scale) are the ones transformers
    computes."""
    args = hf_args(job(CONFIGS[args]), VOCAB, 32) if args in CONFIGS else tiny(args)
    model = initialised(args).train()
    reference = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).train()
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = tokens(vocab=model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(input_ids=ids).logits, rtol=0, atol=0)


def test_gemma_is_initialised_as_transformers_initialises_it():
    """Gemma's RMSNorm computes (1 + weight): its weights start at 0 (gain 1), not at 1; its embedding scale is
    sqrt(hidden_size) and the padding row of the embedding is 0, as `_init_weights` makes them."""
    model = initialised(tiny("gemma"))
    config = model.config
    assert all(bool((m.weight == 0).all()) for m in model.modules() if type(m).__name__ == "GemmaRMSNorm")
    assert model.model.embed_tokens.embed_scale.item() == config.hidden_size**0.5
    assert not model.model.embed_tokens.weight[config.pad_token_id].any()
    assert model.model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(config.initializer_range, rel=0.1)


def test_the_init_plan_is_read_off_transformers_own_init_weights():
    """GPT-2's residual projections draw from a smaller normal (std / sqrt(2 x layers)) than its other matrices, as
    its `_init_weights` says; the output layer tied to the embedding takes the embedding's draws (one key)."""
    args = tiny("gpt2")
    plan = init_plan(transformers.GPT2LMHeadModel, args.config)
    std = args.config.initializer_range
    *_, scaled = plan.ops["transformer.h.0.mlp.c_proj.weight"]
    *_, plain = plan.ops["transformer.h.0.mlp.c_fc.weight"]
    assert dict(scaled.kwargs)["std"] == pytest.approx(std / (2 * args.config.n_layer) ** 0.5)
    assert dict(plain.kwargs)["std"] == std
    assert plan.keys["lm_head.weight"] == "transformer.wte.weight"


def test_state_dict_names_are_transformers_names():
    model = build("qwen2")
    reference = transformers.AutoModelForCausalLM.from_config(model.config)
    assert list(model.state_dict()) == list(reference.state_dict())


def test_pipeline_stages_take_a_dotted_block_path_and_keep_names():
    """An unmodified transformers model splits at `model.layers`; HFCausalLM's split places the modules around the
    layers by their role in the forward: the rotary embedding (registered after the layers, but its output is every
    layer's input) in every stage, the final norm (registered before the rotary embedding) on the last; each pruned
    stage keeps transformers' names (a ModuleList keeps its indices), and the stages run in turn give the whole
    model's logits."""
    config = hf_args(job(CONFIGS["llama"]), VOCAB, 32).config
    with torch.device("meta"):
        raw = transformers.AutoModelForCausalLM.from_config(config)
    assert pipeline_stages(raw, 2, blocks="model.layers") == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1"],
        ["model.layers.2", "model.layers.3", "model.norm", "model.rotary_emb", "lm_head"],
    ]
    model = build("llama")
    stages = decoder_stages(model, 2, split_points=["model.layers.1"])
    assert stages == [
        ["model.embed_tokens", "model.rotary_emb", "model.layers.0"],
        ["model.rotary_emb", "model.layers.1", "model.layers.2", "model.layers.3", "model.norm", "lm_head"],
    ]
    first, second = (prune_to(model, names) for names in stages)
    names = list(model.state_dict())
    assert list(first.state_dict()) + list(second.state_dict()) == names
    assert first.model.layers[1] is None and second.model.embed_tokens is None and first.lm_head is None
    with torch.no_grad():
        torch.testing.assert_close(second(first(tokens())), model(tokens()), rtol=0, atol=0)


def test_hf_stages_may_hold_the_embedding_or_the_output_alone():
    """parallelism.pipeline_parallel_embedding_layers / _output_layers = 1 over 6 stages of the 4-layer Llama: the
    first stage holds the embedding alone (and the rotary table every stage takes), the last the final norm and the
    head, and the stages run in turn give the whole model's logits."""
    model = build("llama")
    stages = decoder_stages(model, 6, embedding_layers=1, output_layers=1)
    assert stages[0] == ["model.embed_tokens", "model.rotary_emb"]
    assert stages[-1] == ["model.rotary_emb", "model.norm", "lm_head"]
    hidden = tokens()
    with torch.no_grad():
        for names in stages:
            hidden = prune_to(model, names)(hidden)
        torch.testing.assert_close(hidden, model(tokens()), rtol=0, atol=0)


def test_initialisation_depends_on_names_not_on_the_split():
    """Each stage initialised on its own holds exactly the whole model's initial values; matrices are drawn with
    the config's initializer_range, biases are zero and norm weights one, as transformers initialises them."""
    model = build("qwen2", seed=7)
    whole = model.state_dict()
    for names in decoder_stages(model, 2):
        stage = prune_to(model, names)
        init_weights(stage, 7)
        for name, value in stage.state_dict().items():
            assert torch.equal(value, whole[name]), name
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied, as the config says
    std = model.config.initializer_range
    assert model.model.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(std, rel=0.05)
    assert not model.model.layers[0].self_attn.q_proj.bias.any()
    assert bool((model.model.norm.weight == 1).all())
    rotary = model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, type(rotary)(config=model.config).inv_freq)


def test_logits_of_reads_tensors_tuples_and_output_objects():
    logits = torch.ones(2, 3)
    output = transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)
    assert logits_of(logits) is logits and logits_of((logits, None)) is logits and logits_of(output) is logits
    with pytest.raises(TypeError, match="Cannot find logits in a dict"):
        logits_of({"scores": logits})


def test_a_plan_key_that_matches_nothing_is_named():
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_args(job(CONFIGS["llama"]), VOCAB, 32).config)
    plan = ParallelPlan(tensor_parallel={"model.layers.*.self_attn.qkv_proj": ColwiseParallel()})
    with pytest.raises(ConfigError, match=r"'model\.layers\.\*\.self_attn\.qkv_proj'.*'model\.layers\.0\.self_attn"
                       r"\.qkv_proj' is not a submodule.*model\.layers\.0\.self_attn\.q_proj"):
        parallelize(model, None, plan, device=torch.device("cpu"), init_weights=lambda m: None)


def test_blocks_are_needed_only_by_what_applies_per_block(mesh):
    """A plan without `blocks` parallelizes; activation checkpointing then asks for it by name, and a wrong
    dotted path is named with the model's children."""
    config = hf_args(job(CONFIGS["llama"]), VOCAB, 32).config

    def meta_model():
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)

    cpu, init = torch.device("cpu"), lambda m: init_weights(m, 0)
    parallel = parallelize(meta_model(), mesh, ParallelPlan(), device=cpu, init_weights=init, loss_fn=lambda o, y: 0)
    assert parallel.forward_only(tokens()).shape == (2, 16, VOCAB)  # the logits of the output object
    with pytest.raises(ConfigError, match=r"activation_checkpoint = 'full' applies per block: set ParallelPlan.blocks"):
        parallelize(meta_model(), mesh, ParallelPlan(activation_checkpoint="full"), device=cpu, init_weights=init)
    with pytest.raises(ConfigError, match=r"no submodule 'model\.blocks'.*its children: model, lm_head"):
        parallelize(meta_model(), mesh, ParallelPlan(blocks="model.blocks", activation_checkpoint="full"), device=cpu,
                    init_weights=init)
    checkpointed = parallelize(meta_model(), mesh, ParallelPlan(blocks="model.layers", activation_checkpoint="full"),
                               device=cpu, init_weights=init)
    assert type(checkpointed.parts[0].model.layers[0]).__name__ == "CheckpointWrapper"
    assert [name for name, _ in checkpointed.named_parameters()] == [name for name, _ in parallel.named_parameters()]


def write(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(CONFIGS["llama"].read_text()) | changes))
    return path


def test_hf_config_errors_name_the_key_and_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"model.name = 'hf' needs model.hf_config"):
        hf_args(job(""), VOCAB, 32)
    with pytest.raises(ConfigError, match=r"model.hf_config = .*missing.json does not exist"):
        hf_args(job(tmp_path / "missing.json"), VOCAB, 32)
    (tmp_path / "broken.json").write_text("{\n  \"model_type\": \"llama\",\n  oops\n}")
    with pytest.raises(UntrustedInput, match=r"broken.json is not valid JSON \(Expecting .* line 3"):
        hf_args(job(tmp_path / "broken.json"), VOCAB, 32)
    with pytest.raises(ConfigError, match=r"model_type = 'bert' is not a model torchpre trains: .* encoder family"):
        hf_args(job(write(tmp_path, model_type="bert")), VOCAB, 32)
    with pytest.raises(ConfigError, match=r"model_type = 'gemma3' is not a model torchpre trains: .* multimodal"):
        hf_args(job(write(tmp_path, model_type="gemma3")), VOCAB, 32)
    with pytest.raises(ConfigError, match=r"attention_dropout = 0.1: a random training forward .* Set them to 0.0"):
        hf_args(job(write(tmp_path, attention_dropout=0.1)), VOCAB, 32)
    with pytest.raises(ConfigError, match=r"vocab_size = 1000 is smaller than the tokenizer's 2048 ids"):
        hf_args(job(write(tmp_path, vocab_size=1000)), VOCAB, 32)
    with pytest.raises(ConfigError, match=r"training.seq_len = 1024 is longer than the model's max_position_embed"):
        hf_args(job(write(tmp_path)), VOCAB, 1024)
    assert hf_args(job(write(tmp_path, model_type="mistral", sliding_window=16)), VOCAB, 32)  # transformers' own masks
    with pytest.raises(ConfigError, match=r"training.document_mask is not supported with model.name = 'hf'"):
        hf_args(job(write(tmp_path), document_mask=True), VOCAB, 32)
    assert hf_args(job(tmp_path), VOCAB, 32).config.model_type == "llama"  # a folder holding config.json
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM \(model_type 'llama'\) under tensor parallel: refused: "
                       r"num_key_value_heads = 2 is not divisible by parallelism.tensor_parallel_degree = 4 .*1, 2\)"):
        validate_tensor_parallel(hf_args(job(tmp_path), VOCAB, 32), 4)
