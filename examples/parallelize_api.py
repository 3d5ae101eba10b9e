"""The parallelize API on its own, without train.py: the GPT-2 of custom_model.py trained under
dp x tp 2 x pp 2 (1F1B) with ZeRO-1 and activation checkpointing, on any number of processes that 4 divides.

    torchrun --nproc_per_node=4 examples/parallelize_api.py

Everything the trainer otherwise does is spelled out here: the process group, the mesh, the loss scaled
to a mean over the global batch, each data-parallel rank's slice of it, and the logged global loss.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from custom_model import GPT2, TP_PLAN, GPT2Args  # this file's folder is on sys.path when run as a script

from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.distributed.process_groups import init_distributed, select_device
from torchpre.optim import build_optimizer
from torchpre.parallel import ParallelPlan, PipelinePlan, parallelize, pipeline_stages

TP, PP, MICROBATCHES = 2, 2, 4
GLOBAL_BATCH, SEQ_LEN, STEPS, SEED = 16, 32, 10, 0


def main() -> None:
    device = select_device()  # CUDA with NCCL when there is a GPU, else CPU with gloo
    init_distributed(device)  # torchrun's environment -> the process group
    dims = ParallelDims.from_degrees(dp=-1, tp=TP, pp=PP, world_size=dist.get_world_size())
    mesh = dims.build_mesh(device.type)  # dims ("pp", "dp", "tp")
    args = GPT2Args(vocab_size=256, max_seq_len=SEQ_LEN)
    with torch.device("meta"):  # never materialised whole: each rank allocates only its shards and stage
        model = GPT2(args)
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This microbatch's share of the mean over the global batch: summed over microbatches, pipeline
        chunks and DP ranks (the optimizer sums gradients over DP), it is exactly the global mean."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens_per_step

    stages = pipeline_stages(model, PP, blocks="h")  # wte, wpe and the first half of h | the rest, ln_f, lm_head
    plan = ParallelPlan(
        tensor_parallel=TP_PLAN,
        pipeline=PipelinePlan.build(stages, pp=PP, schedule="1F1B", n_microbatches=MICROBATCHES),
        blocks="h",
        tied_weights=("wte.weight", "lm_head.weight"),
        activation_checkpoint="full",
    )
    model = parallelize(model, mesh, plan, device=device, init_weights=lambda m: m.init_weights(SEED), loss_fn=loss_fn)
    optimizer = build_optimizer(model, zero_stage=1, lr=3e-3)  # AdamW on fp32 masters, state sharded over dp

    # One fixed global batch, so the loss visibly falls; each DP rank trains on its slice of it.
    batch = torch.randint(0, args.vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    mine = batch.chunk(dims.dp)[mesh["dp"].get_local_rank()].to(device)
    for step in range(1, STEPS + 1):
        loss = model.forward_backward([(mine[:, :-1], mine[:, 1:])])  # this rank's share (0 off the last stage)
        grad_norm = optimizer.step()  # DP reduce-scatter, global clipping norm, AdamW, all-gather
        for group in ("dp", "pp"):  # the global loss: sum the DP shares, take it from the last stage
            dist.all_reduce(loss, group=mesh[group].get_group())
        if dist.get_rank() == 0:
            print(f"step {step:2d} | loss {loss.item():.4f} | grad norm {grad_norm.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
