"""`optimizer.name` -> torch optimizer class, the keys each reads, and the state a checkpoint finds before the
first step."""

import pytest
import torch
from torch import nn

from torchpre.config.job_config import BUILT_IN_OPTIMIZERS, JobConfig, Optimizer
from torchpre.errors import ConfigError
from torchpre.optim import OptimizerSpec, build_optimizer, get_optimizer, optimizer_names, register_optimizer
from torchpre.optim.muon import NS_COEFFICIENTS, Muon
from torchpre.optim.registry import (
    DEFAULT_HYPERPARAMETERS,
    check_config,
    constructor_kwargs,
    hyperparameters_from_config,
)
from torchpre.parallel import ParallelPlan, parallelize

HYPERPARAMETERS = {"lr": 0.1, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1, "momentum": 0.5}


def test_names_select_torch_classes():
    expected = {
        "AdamW": torch.optim.AdamW,
        "Adam": torch.optim.Adam,
        "SGD": torch.optim.SGD,
        "Adagrad": torch.optim.Adagrad,
        "RMSprop": torch.optim.RMSprop,
        "Muon": Muon,
    }
    assert {name: get_optimizer(name).cls for name in optimizer_names()} == expected


def test_each_optimizer_gets_only_the_arguments_it_takes():
    assert constructor_kwargs(get_optimizer("AdamW"), HYPERPARAMETERS) == {"lr": 0.1, "betas": (0.8, 0.9), "eps": 1e-6}
    assert constructor_kwargs(get_optimizer("SGD"), HYPERPARAMETERS) == {"lr": 0.1, "momentum": 0.5}
    assert constructor_kwargs(get_optimizer("Adagrad"), HYPERPARAMETERS) == {"lr": 0.1, "eps": 1e-6}
    assert constructor_kwargs(get_optimizer("RMSprop"), HYPERPARAMETERS) == {"lr": 0.1, "eps": 1e-6, "momentum": 0.5}


def test_config_keys_make_the_constructor_arguments():
    config = JobConfig().optimizer
    config.beta1, config.beta2, config.momentum = 0.8, 0.9, 0.5
    muon = {key: getattr(config, key) for key in vars(config) if key.startswith("muon_")}
    assert len(muon) == 7
    assert hyperparameters_from_config(vars(config)) == {
        "lr": config.lr,
        "weight_decay": config.weight_decay,
        "betas": (0.8, 0.9),
        "eps": config.eps,
        "momentum": 0.5,
        **muon,
    }


def test_an_unknown_name_lists_the_valid_ones_and_the_closest():
    with pytest.raises(ConfigError, match="'adamw' is not a registered optimizer. Did you mean 'AdamW'?") as error:
        get_optimizer("adamw")
    assert "Choose one of: AdamW, Adam, SGD, Adagrad, RMSprop, Muon." in str(error.value)


def _config(tmp_path, **optimizer) -> JobConfig:
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    for key, value in optimizer.items():
        setattr(config.optimizer, key, value)
    return config


def test_config_validation_names_the_unknown_optimizer(tmp_path):
    with pytest.raises(ConfigError, match="optimizer.name = 'Lion' is not a registered optimizer"):
        check_config(_config(tmp_path, name="Lion").optimizer, {})


def test_a_changed_key_the_optimizer_does_not_read_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"optimizer.beta2 = 0.99: SGD does not use this key") as error:
        check_config(_config(tmp_path, name="SGD", momentum=0.9, beta2=0.99).optimizer, {})
    assert "optimizer.lr, optimizer.momentum, optimizer.weight_decay" in str(error.value)
    with pytest.raises(ConfigError, match="optimizer.momentum = 0.9: AdamW does not use this key"):
        check_config(_config(tmp_path, name="AdamW", momentum=0.9).optimizer, {})
    check_config(_config(tmp_path, name="SGD", momentum=0.9, lr=0.1).optimizer, {})  # keys it reads, others at defaults


def test_muon_keys_are_refused_for_other_optimizers_and_read_by_muon(tmp_path):
    with pytest.raises(ConfigError, match="optimizer.muon_momentum = 0.9: AdamW does not use this key"):
        check_config(_config(tmp_path, name="AdamW", muon_momentum=0.9).optimizer, {})
    with pytest.raises(ConfigError, match="optimizer.momentum = 0.9: Muon does not use this key"):
        check_config(_config(tmp_path, name="Muon", momentum=0.9).optimizer, {})
    with pytest.raises(ConfigError, match=r"optimizer.muon_ns_steps = 0 must be between 1 and 99"):
        check_config(_config(tmp_path, name="Muon", muon_ns_steps=0).optimizer, {})
    check_config(_config(tmp_path, name="Muon", muon_momentum=0.9, beta2=0.99).optimizer, {})


SHARDS = {"optimizer.zero_stage = 0": False, "parallelism.tensor_parallel_degree = 1": False,
          "parallelism.expert_parallel_degree = 1": False}
SHARDED = {"optimizer.zero_stage": "optimizer.zero_stage = 1", "parallelism.tensor_parallel_degree":
           "parallelism.tensor_parallel_degree = 2", "parallelism.expert_parallel_degree":
           "parallelism.expert_parallel_degree = 2"}


@pytest.mark.parametrize(
    "sharded", ["optimizer.zero_stage", "parallelism.tensor_parallel_degree", "parallelism.expert_parallel_degree"]
)
def test_an_update_that_is_not_elementwise_is_refused_on_shards(tmp_path, sharded, monkeypatch):
    """An optimizer that reads whole matrices and cannot assemble them would step each shard on its own: refused
    where ranks hold shards, allowed where they hold whole matrices (data and pipeline parallelism), and Muon,
    which assembles them, is allowed everywhere."""
    from torchpre.optim import registry

    spec = OptimizerSpec(torch.optim.Muon, ("lr", "weight_decay"), elementwise=False)
    monkeypatch.setitem(registry._REGISTRY, "TorchMuon", spec)
    config = _config(tmp_path, name="TorchMuon").optimizer
    check_config(config, SHARDS)
    with pytest.raises(ConfigError, match=f"optimizer.name = 'TorchMuon': its update is not elementwise.*{sharded}"):
        check_config(config, {**SHARDS, SHARDED[sharded]: True})
    check_config(_config(tmp_path, name="Muon").optimizer, {**SHARDS, SHARDED[sharded]: True})


def test_a_torch_class_known_not_elementwise_cannot_be_registered_as_elementwise():
    with pytest.raises(ValueError, match="Muon's update is not elementwise"):
        OptimizerSpec(torch.optim.Muon, ("lr", "weight_decay"))


def test_fused_only_on_cuda_where_the_class_has_it():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not get_optimizer("AdamW").uses_fused(cpu)
    assert get_optimizer("AdamW").uses_fused(cuda) and get_optimizer("SGD").uses_fused(cuda)
    assert not get_optimizer("RMSprop").uses_fused(cuda)  # no fused RMSprop in torch
    assert not get_optimizer("Adagrad").uses_fused(cuda)  # declared off in the registry


def test_the_implementation_key_forces_or_forbids_the_fused_kernel_on_any_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert get_optimizer("AdamW").uses_fused(cpu, "fused") and get_optimizer("SGD").uses_fused(cpu, "fused")
    assert not get_optimizer("AdamW").uses_fused(cuda, "foreach")
    with pytest.raises(ConfigError, match="optimizer.implementation = 'fused': RMSprop has no fused implementation"):
        check_config(Optimizer(name="RMSprop", implementation="fused"), {})  # the [optimizer] step, before any work
    with pytest.raises(ConfigError, match="Adagrad has no fused implementation"):  # declared off in the registry
        check_config(Optimizer(name="Adagrad", implementation="fused"), {})


def test_registering_a_taken_name_is_an_error():
    with pytest.raises(ValueError, match="'SGD' is already registered"):
        register_optimizer("SGD", OptimizerSpec(torch.optim.SGD, ("lr", "weight_decay")))


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(8, 6), "1": nn.Linear(6, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["1"](torch.tanh(self.layers["0"](x)))


def _train(mesh, name: str, state_first: bool) -> tuple[dict, dict]:
    """Two steps of `name` on TwoLayers from a fixed init, asking for its state before the first one or not:
    the final parameters and state."""
    with torch.device("meta"):
        model = TwoLayers()

    def init(module: nn.Module) -> None:
        generator = torch.Generator().manual_seed(0)
        for param in module.parameters():
            param.data.copy_(torch.randn(param.shape, generator=generator))

    model = parallelize(model, mesh, ParallelPlan(blocks="layers"), device=torch.device("cpu"), init_weights=init)
    momentum = 0.9 if name in ("SGD", "RMSprop") else 0.0
    # vocab_size: Muon's output layer (TwoLayers' last, 4 wide) stays in AdamW, its first layer is Muon's
    optimizer = build_optimizer(model, name=name, lr=0.01, momentum=momentum, max_norm=0.0, vocab_size=4)
    if state_first:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = optimizer.state_dict()
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "the warm-up moved a parameter"
        assert state["layers.0.weight"], "no state before the first step"
        assert all(v == 0 for v in _plain(state).values() if v.ndim == 0), "a step count is not back at 0"
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model.parts[0](inputs).square().sum().backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, _plain(optimizer.state_dict())


def _plain(state: dict) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": (value.to_local() if hasattr(value, "to_local") else torch.as_tensor(value)).clone()
        for name, entries in state.items()
        for key, value in entries.items()
    }


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD", "Adagrad", "RMSprop", "Muon"])
def test_state_created_before_the_first_step_changes_nothing(mesh, name):
    """A checkpoint may be saved, or loaded into, before the first step: the state it creates then has the
    keys the first step would create, and the training afterwards is bitwise the same."""
    params, state = _train(mesh, name, state_first=False)
    warmed_params, warmed_state = _train(mesh, name, state_first=True)
    assert warmed_state.keys() == state.keys()
    assert all(torch.equal(warmed_params[n], params[n]) for n in params)
    assert all(torch.equal(warmed_state[k], state[k]) for k in state), name


def _no_init(part: nn.Module) -> None:
    """The weights' values do not matter to the test."""


def test_build_optimizer_asks_for_the_fused_kernel_on_cuda_only(mesh, monkeypatch):
    with torch.device("meta"):
        module = TwoLayers()
    model = parallelize(module, mesh, ParallelPlan(blocks="layers"), device=torch.device("cpu"), init_weights=_no_init)
    assert not build_optimizer(model, name="AdamW").inner.defaults["fused"]
    asked = []  # the device it decides on is the parameters'
    monkeypatch.setattr(
        OptimizerSpec, "uses_fused", lambda spec, device, implementation: asked.append(device) or False
    )
    build_optimizer(model, name="AdamW")
    assert asked == [torch.device("cpu")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused AdamW runs on CUDA")
def test_fused_adamw_on_cuda_equals_foreach_after_one_step():
    """The fused kernel `uses_fused` picks on CUDA computes the same update as the foreach one it replaces: fp32,
    one step from the same state and gradients, within 1e-6 (a few ulps of the ~1e-1 weights: the kernels
    order the same per-element arithmetic differently)."""
    spec, device = get_optimizer("AdamW"), torch.device("cuda")
    assert spec.uses_fused(device)
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (16, 64)]
    weights = [torch.randn(shape, generator=generator) * 0.1 for shape in shapes]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    kwargs = constructor_kwargs(spec, HYPERPARAMETERS)
    results = []
    for implementation in ({"fused": True}, {"foreach": True}):
        params = [w.to(device).requires_grad_() for w in weights]
        groups = [  # as the distributed optimizer groups them: matrices decay, vectors do not
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        optimizer = spec.cls(groups, **kwargs, **implementation)
        for param, grad in zip(params, grads):
            param.grad = grad.to(device)
        optimizer.step()
        results.append([p.detach().cpu() for p in params])
    for fused, foreach, before in zip(*results, weights):
        assert not torch.equal(fused, before)
        torch.testing.assert_close(fused, foreach, rtol=0, atol=1e-6)


def test_the_help_names_the_registry_s_optimizers_and_build_takes_the_config_s_defaults():
    """--help (torch-free) names the built-in rows, and `build_optimizer` fills what a caller leaves out with the
    config's defaults: one set of names and defaults, whichever way an optimizer is built."""
    assert tuple(optimizer_names()[: len(BUILT_IN_OPTIMIZERS)]) == BUILT_IN_OPTIMIZERS
    defaults = JobConfig().optimizer
    assert DEFAULT_HYPERPARAMETERS["lr"] == defaults.lr == 8e-4
    assert DEFAULT_HYPERPARAMETERS["betas"] == (defaults.beta1, defaults.beta2)
    assert DEFAULT_HYPERPARAMETERS["muon_ns_coefficients"] == tuple(defaults.muon_ns_coefficients) == NS_COEFFICIENTS
