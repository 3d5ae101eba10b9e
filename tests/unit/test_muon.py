"""Muon at one process: its Newton-Schulz iteration is torch's, its hybrid step is torch.optim.Muon on the hidden
matrices plus torch.optim.AdamW on the rest, and it chooses those matrices as practitioners do. Its layouts are in
tests/distributed/test_optimizers.py (parity with one process) and test_whole_matrices.py (the assembly)."""

import pytest
import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz

from torchpre.errors import ConfigError
from torchpre.optim import build_optimizer
from torchpre.optim.muon import NS_COEFFICIENTS, NS_EPS, check_settings, hidden_matrices, lr_scale, orthogonalize
from torchpre.optim.registry import DEFAULT_HYPERPARAMETERS, hyperparameters_from_config
from torchpre.parallel import ParallelPlan, parallelize

VOCAB = 40


@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (20, 20)])
def test_one_matrix_in_bf16_is_torchs_newton_schulz(shape):
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    expected = _zeropower_via_newtonschulz(matrix, NS_COEFFICIENTS, 5, NS_EPS).float()
    assert torch.equal(orthogonalize(matrix, NS_COEFFICIENTS, 5, torch.bfloat16), expected)


def test_a_stack_is_orthogonalized_matrix_by_matrix():
    """Experts' weights (a stack) go through the batched matmuls: the same as one matrix at a time (fp32: the
    batched and single kernels may order a sum differently, ~1e-7)."""
    stack = torch.randn(3, 12, 20, generator=torch.Generator().manual_seed(1))
    each = torch.stack([orthogonalize(m, dtype=torch.float32) for m in stack])
    torch.testing.assert_close(orthogonalize(stack, dtype=torch.float32), each, rtol=0, atol=1e-6)


def test_the_result_is_nearly_orthogonal():
    """The quintic iteration does not converge to U Vᵀ but puts every singular value in about [0.7, 1.2]
    (Keller Jordan): an input spread over 2.5 decades comes out within [0.68, 1.19] (measured)."""
    u, _, v = torch.linalg.svd(torch.randn(32, 48, generator=torch.Generator().manual_seed(2)), full_matrices=False)
    matrix = u @ torch.diag(torch.logspace(-1.5, 1, 32)) @ v
    singular = torch.linalg.svdvals(orthogonalize(matrix, dtype=torch.float32))
    assert singular.min() > 0.65 and singular.max() < 1.25, singular


def test_learning_rate_scales():
    assert lr_scale((1024, 4096), "match_rms_adamw") == pytest.approx(0.2 * 64)
    assert lr_scale((4096, 1024), "original") == pytest.approx(2.0)
    assert lr_scale((1024, 4096), "original") == 1.0
    assert lr_scale((8, 64, 16), "spectral_unclamped") == pytest.approx(2.0)  # a stack: the matrices' shape
    assert lr_scale((4096, 1024), "none") == 1.0


class Tiny(nn.Module):
    """An embedding, two hidden blocks with biases and a norm, an output layer of the vocabulary's size."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleDict({"0": nn.Linear(16, 24), "1": nn.Linear(24, 16)})
        self.norm = nn.RMSNorm(16)
        self.output = nn.Linear(16, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.layers["1"](torch.tanh(self.layers["0"](self.embed(tokens))))
        return self.output(self.norm(hidden))


def test_hidden_matrices_are_the_blocks_matrices():
    model = Tiny()
    named = list(model.named_parameters())
    assert hidden_matrices(named, VOCAB, [], {"embed.weight"}) == {"layers.0.weight", "layers.1.weight"}
    assert hidden_matrices(named, VOCAB, ["layers.1.*"], {"embed.weight"}) == {"layers.0.weight"}
    # the vocabulary rule alone keeps the embedding and the output layer out
    assert hidden_matrices(named, VOCAB, [], set()) == {"layers.0.weight", "layers.1.weight"}


def _init(module: nn.Module) -> None:
    generator = torch.Generator().manual_seed(0)
    for param in module.parameters():
        param.data.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def test_one_process_equals_torch_muon_plus_adamw(mesh):
    """torchpre's Muon (bf16 iteration, torch's defaults) against torch.optim.Muon on the hidden matrices and
    torch.optim.AdamW on the rest (matrices decayed, vectors not), 5 steps, no clipping: parameters within 1e-6
    (measured 0: the same operations in the same order)."""
    lr, decay, steps = 0.02, 0.1, 5
    with torch.device("meta"):
        model = Tiny()
    model = parallelize(model, mesh, ParallelPlan(blocks="layers"), device=torch.device("cpu"), init_weights=_init)
    optimizer = build_optimizer(model, name="Muon", vocab_size=VOCAB, lr=lr, weight_decay=decay, max_norm=0.0)
    reference = Tiny()
    _init(reference)
    hidden = [reference.layers["0"].weight, reference.layers["1"].weight]
    muon = torch.optim.Muon(hidden, lr=lr, weight_decay=decay, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(
        [{"params": [reference.embed.weight, reference.output.weight], "weight_decay": decay},
         {"params": [reference.layers["0"].bias, reference.layers["1"].bias, reference.norm.weight],
          "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 8), generator=generator)
        model.parts[0](tokens).logsumexp(-1).mean().backward()
        optimizer.step()
        reference(tokens).logsumexp(-1).mean().backward()
        muon.step(), adamw.step()
        muon.zero_grad(), adamw.zero_grad()
    initial = Tiny()
    _init(initial)
    for name, param in model.parts[0].named_parameters():
        expected = reference.get_parameter(name)
        assert (expected - initial.get_parameter(name)).abs().max() > 1e-3, f"{name} did not move"
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=0, atol=1e-6, msg=name)


def test_state_before_the_first_step_is_the_first_steps(mesh):
    """A checkpoint saved or loaded before the first step creates Muon's state (momentum buffers at 0, AdamW's
    moments) without the step's collective, and the training after it is bitwise the same."""

    def train(state_first: bool) -> list[torch.Tensor]:
        with torch.device("meta"):
            module = Tiny()
        model = parallelize(module, mesh, ParallelPlan(blocks="layers"), device=torch.device("cpu"), init_weights=_init)
        optimizer = build_optimizer(model, name="Muon", vocab_size=VOCAB, lr=0.02, max_norm=0.0)
        if state_first:
            state = optimizer.state_dict()
            assert set(state["layers.0.weight"]) == {"momentum_buffer"}
            assert set(state["embed.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
        tokens = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            model.parts[0](tokens).logsumexp(-1).mean().backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parts[0].parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(False), train(True)))


def test_bad_settings_are_named():
    values = hyperparameters_from_config(
        {"muon_momentum": 1.0, "muon_ns_steps": 0, "muon_ns_coefficients": [1.0, 2.0], "muon_ns_dtype": "float16",
         "muon_lr_adjust": "adam", "muon_nesterov": True, "muon_adamw_params": [],
         **{k: 0.0 for k in ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum")}}
    )  # fmt: skip
    with pytest.raises(ConfigError) as error:
        check_settings(values)
    for key in ("muon_momentum = 1.0", "muon_ns_steps = 0", "muon_ns_coefficients", "muon_ns_dtype", "muon_lr_adjust"):
        assert f"optimizer.{key}" in str(error.value)
    check_settings(DEFAULT_HYPERPARAMETERS)
