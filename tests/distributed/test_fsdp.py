"""ZeRO-3 (FSDP2 + FullyShardedOptimizer) against ZeRO-0 through the parallelize API, on two gloo ranks in one
spawn: gradients, the global norm and the updated parameters of one step; the tied embedding as one FSDP
parameter; optimizer state laid out as FSDP's parameters; `discard`; and the bytes per parameter."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tests.gpt2_model import GPT2, GPT2Args
from tests.launch import spawn
from tests.optimizers import entries
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.optim import build_optimizer
from torchpre.parallel import ParallelPlan, parallelize
from torchpre.parallel.data_parallel import FSDPPlan

# fp32 on CPU: ZeRO-3 changes only the order of the DP sum (reduce-scatter over shards instead of an all-reduce
# of whole gradients) and where the norm's squares are summed: gradients and norms ~1e-9 apart. AdamW's first
# update is lr * g / (|g| + eps), which amplifies that noise for the few elements with |g| near eps: at lr 1e-2
# one of 4096 moved 1.1e-6, so the step uses lr 1e-3 (a ~1e-7 effect) and the bound stays 1e-6.
ATOL = 1e-6
LR = 1e-3
ARGS = GPT2Args(vocab_size=64)
TIED = ("wte.weight", "lm_head.weight")
MICROBATCHES = 2
TOKENS = torch.randint(0, ARGS.vocab_size, (2 * 2 * MICROBATCHES, 9), generator=torch.Generator().manual_seed(0))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """This rank's share of the global mean: divided by the global token count, as the trainer's loss is."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / TOKENS[:, 1:].numel()


def _build(meshes, fsdp: bool):
    with torch.device("meta"):
        model = GPT2(ARGS)
    plan = ParallelPlan(blocks="h", tied_weights=TIED, fsdp=FSDPPlan() if fsdp else None)
    parallel = parallelize(model, meshes.mesh, plan, device=torch.device("cpu"),
                           init_weights=lambda m: m.init_weights(3), loss_fn=_loss,
                           dp_mesh=meshes.fsdp_mesh if fsdp else None)
    optimizer = build_optimizer(parallel, zero_stage=3 if fsdp else 0, lr=LR, max_norm=0.05)
    return parallel, optimizer


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _backward(parallel) -> None:
    rank = dist.get_rank()
    mine = TOKENS.chunk(2)[rank].chunk(MICROBATCHES)
    parallel.forward_backward([(t[:, :-1], t[:, 1:]) for t in mine])


def _check_one_step_matches_zero0(meshes) -> None:
    ref_model, ref_opt = _build(meshes, fsdp=False)
    model, opt = _build(meshes, fsdp=True)
    part = model.parts[0]
    assert part.wte.weight is part.lm_head.weight, "the tied embedding must stay one FSDP parameter"
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in ref_model.named_parameters()]
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), (name, p)
        assert torch.equal(p.full_tensor(), q.detach()), f"{name}: initial weights differ"

    _backward(ref_model)
    _backward(model)
    ref_norm, norm = ref_opt.reduce_gradients(), opt.reduce_gradients()
    torch.testing.assert_close(norm, ref_norm, rtol=0, atol=ATOL)
    assert norm > 0.05, "the norm must exceed max_norm, so clipping is part of the comparison"
    ref_grads = {e.name: e.master.grad for e in entries(ref_opt)}
    for entry in entries(opt):  # divided by dp instead of summed, these would be half the reference
        torch.testing.assert_close(entry.param.grad.full_tensor(), ref_grads[entry.name], rtol=0, atol=ATOL,
                                   msg=f"gradient of {entry.name}")

    before = {name: p.detach().full_tensor() for name, p in model.named_parameters()}
    state_before = {name: {k: _full(v).clone() for k, v in s.items()} for name, s in opt.state_dict().items()}
    opt.discard()
    assert all(e.param.grad is None for e in entries(opt))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().full_tensor(), before[name]), f"discard moved {name}"
    for name, state in opt.state_dict().items():
        for key, value in state.items():
            assert torch.equal(_full(value), state_before[name][key]), f"discard moved {name}.{key}"

    _backward(model)  # the same step again, now applied
    opt.reduce_gradients()
    ref_opt.apply()
    opt.apply()
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=0, atol=ATOL,
                                   msg=lambda m, name=name: f"{name} after apply: {m}")
    state = opt.state_dict()
    assert TIED[1] in state and "master" not in state[TIED[0]], sorted(state[TIED[0]])
    for entry in entries(opt):
        moment = state[entry.name]["exp_avg"]
        assert moment.placements == entry.param.placements and moment.device_mesh == entry.param.device_mesh


def _check_bytes_per_parameter(meshes) -> None:
    """AdamW fp32 on the debug model at dp2 (every dim-0 size even): 4/dp, 4/dp and 8/dp bytes per parameter, plus
    AdamW's 4-byte step count per parameter tensor (as every stage counts it)."""
    args = LLAMA3_FLAVORS["debugmodel"]
    with torch.device("meta"):
        model = Transformer(args)
    count = sum(p.numel() for p in model.parameters())
    plan = ParallelPlan(fsdp=FSDPPlan())
    parallel = parallelize(model, meshes.mesh, plan, device=torch.device("cpu"), init_weights=lambda m: None,
                           dp_mesh=meshes.fsdp_mesh)
    optimizer = build_optimizer(parallel, zero_stage=3)
    optimizer.state_dict()  # creates the state as the first step would
    dp = 2
    assert optimizer.param_bytes() * dp == 4 * count
    assert optimizer.grad_bytes() * dp == 4 * count
    assert optimizer.state_bytes() == 8 * count // dp + 4 * len(list(model.parameters()))


def _check_all(mesh: DeviceMesh) -> None:
    meshes = ParallelDims.from_degrees(dp=2, tp=1, pp=1, world_size=2).build_meshes("cpu", fsdp=True)
    _check_one_step_matches_zero0(meshes)
    _check_bytes_per_parameter(meshes)


def test_zero3_matches_zero0_on_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # FSDP on gloo with a visible GPU crashes (pytorch/pytorch#132471)
    spawn(_check_all, world_size=2, store_path=tmp_path / "store")
