"""FSDP2 units per sub-layer (`parallelism.fsdp_wrap = "sublayer"`) against units per block, through the
parallelize API on two gloo ranks: the same gradients, and half the gathered parameters at the peak.

The gathered bytes are counted directly, at every op of a forward and backward, as the parameters FSDP2 holds
unsharded (`ShardedState.UNSHARDED`): bench/memory_worker.py's storage counter does not see FSDP2 free them (it
frees with `storage.resize_(0)`).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
from torch.utils._python_dispatch import TorchDispatchMode

from tests.launch import spawn
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.models.llama3.spec import SPEC
from torchpre.parallel import ParallelPlan, parallelize
from torchpre.parallel.data_parallel import FSDPPlan

ARGS = LLAMA3_FLAVORS["debugmodel"]
TOKENS = torch.randint(0, ARGS.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))


class GatheredBytes(TorchDispatchMode):
    """The most bytes of gathered parameters FSDP2 held at any op, over the units of `modules`: a unit's count from
    its all-gather's start (a prefetch's output buffer) until it reshards (its parameters unsharded)."""

    def __init__(self, modules: list[FSDPModule]) -> None:
        super().__init__()
        self.groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.peak = max(self.peak, sum(_unit_bytes(g) for g in self.groups if _gathered(g)))
        return func(*args, **(kwargs or {}))


def _gathered(group) -> bool:
    unsharded = any(p.sharded_state == ShardedState.UNSHARDED for p in group.fsdp_params)
    return unsharded or group._all_gather_result is not None


def _unit_bytes(group) -> int:
    return sum(p._orig_size.numel() * (p.param_dtype or p.orig_dtype).itemsize for p in group.fsdp_params)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / TOKENS[:, 1:].numel()


def _gradients_and_peak(meshes, sublayers: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], int]:
    """Each gradient, whole, after one forward and backward of this rank's half of the batch, and the gathered
    peak of the blocks' units (the root, which FSDP2 never reshards after forward, is left out)."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    plan = ParallelPlan(blocks=SPEC.build.blocks, fsdp=FSDPPlan(sublayers=sublayers))
    parallel = parallelize(model, meshes.mesh, plan, device=torch.device("cpu"),
                           init_weights=lambda m: m.init_weights(3), loss_fn=_loss, dp_mesh=meshes.fsdp_mesh)
    part = parallel.parts[0]
    units = [m for m in part.modules() if isinstance(m, FSDPModule) and m is not part]
    tokens = TOKENS.chunk(2)[dist.get_rank()]
    with GatheredBytes(units) as gathered:
        parallel.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    grads = {name: p.grad.full_tensor() for name, p in parallel.named_parameters()}
    return grads, gathered.peak


def _check_sublayers_gather_half(mesh: DeviceMesh) -> None:
    meshes = ParallelDims.from_degrees(dp=2, tp=1, pp=1, world_size=2).build_meshes("cpu", fsdp=True)
    block_grads, block_peak = _gradients_and_peak(meshes, ())
    sublayer_grads, sublayer_peak = _gradients_and_peak(meshes, SPEC.build.sublayers)
    assert sublayer_grads.keys() == block_grads.keys()
    for name, grad in block_grads.items():  # the same sums over the same two ranks, per element: bitwise
        assert torch.equal(sublayer_grads[name], grad), name
    with torch.device("meta"):
        block = sum(p.numel() for p in Transformer(ARGS).layers["0"].parameters()) * 4  # fp32: no param_dtype
    # 256 x (256 + 2 x 128 + 256) attention + 3 x 256 x 768 feed-forward + 2 norms of 256, fp32.
    assert block == 3_147_776
    # Per block: the running block and the one backward prefetches. Per sub-layer: the feed-forward running in
    # backward, the attention prefetched and their block's norms: one block (what the planner prices).
    assert block_peak == 2 * block
    assert sublayer_peak == block


def test_sublayer_units_give_block_gradients_and_gather_half(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # FSDP on gloo with a visible GPU crashes (pytorch/pytorch#132471)
    spawn(_check_sublayers_gather_half, world_size=2, store_path=tmp_path / "store")
