"""The parallelize API on someone else's model, unmodified: transformers' `LlamaForCausalLM` built from a config,
trained under dp x tp 2 with ZeRO-1 and activation checkpointing per decoder layer, on any number of processes
that 2 divides (dp = world size / 2).

    torchrun --nproc_per_node=4 examples/hf_parallelize.py

The tensor-parallel plan names transformers' own modules; `blocks="model.layers"` is the dotted path of its
decoder layers; the loss function gets what the model returns (a `CausalLMOutputWithPast`) and reads its
logits with `logits_of`. No weights are downloaded: every rank draws its shards from the seed.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import LlamaConfig, LlamaForCausalLM

from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.distributed.process_groups import init_distributed, select_device
from torchpre.models.hf.model import init_weights
from torchpre.optim import build_optimizer
from torchpre.parallel import ParallelPlan, logits_of, parallelize

TP = 2
GLOBAL_BATCH, SEQ_LEN, STEPS, SEED = 8, 32, 6, 0
CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    use_cache=False,
)
# Megatron-style sharding on transformers' module paths: attention and MLP column- then row-parallel, the output
# layer column-parallel with its logits gathered; the embedding and the norms stay replicated.
TP_PLAN = {
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
    "lm_head": ColwiseParallel(output_layouts=Replicate()),
}


def global_batch() -> torch.Tensor:
    """One fixed batch of GLOBAL_BATCH sequences of SEQ_LEN + 1 tokens, so that the loss visibly falls."""
    return torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))


def loss_fn(output, labels: torch.Tensor) -> torch.Tensor:
    """This rank's share of the mean over the global batch: summed over the DP ranks (the optimizer sums their
    gradients), it is exactly the global mean."""
    logits = logits_of(output)  # output is transformers' CausalLMOutputWithPast
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens_per_step


def main() -> None:
    device = select_device()  # CUDA with NCCL when there is a GPU, else CPU with gloo
    init_distributed(device)  # torchrun's environment -> the process group
    dims = ParallelDims.from_degrees(dp=-1, tp=TP, pp=1, world_size=dist.get_world_size())
    mesh = dims.build_mesh(device.type)  # dims ("pp", "dp", "tp")
    with torch.device("meta"):  # never materialised whole: each rank allocates only its shards
        model = LlamaForCausalLM(CONFIG)
    plan = ParallelPlan(tensor_parallel=TP_PLAN, blocks="model.layers", activation_checkpoint="full")
    model = parallelize(model, mesh, plan, device=device, init_weights=lambda m: init_weights(m, SEED), loss_fn=loss_fn)
    optimizer = build_optimizer(model, zero_stage=1, lr=3e-3)  # AdamW on fp32 masters, state sharded over dp

    mine = global_batch().chunk(dims.dp)[mesh["dp"].get_local_rank()].to(device)  # this DP rank's slice
    for step in range(1, STEPS + 1):
        loss = model.forward_backward([(mine[:, :-1], mine[:, 1:])])  # this rank's share of the global mean
        grad_norm = optimizer.step()  # DP reduce-scatter, global clipping norm, AdamW, all-gather
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the global loss: the sum of the DP shares
        if dist.get_rank() == 0:
            print(f"step {step:2d} | loss {loss.item():.6f} | grad norm {grad_norm.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
