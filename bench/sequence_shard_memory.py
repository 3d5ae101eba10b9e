"""One block's saved activations with and without parallelism.sequence_parallel_save_shard, and with both it and
activation_checkpoint.recompute_mlp_activation, by the planner's probe.

Probes the first microbatch of the first Llama 3 paper row of the corpus (`bench.published_runs.LLAMA3_ROWS`:
Llama 3 405B, tp8 + SP, seq 8192, microbatch 1) on the meta device, as the planner prices it, and prints the block's
saved bytes and the peak of its temporaries above them, in MiB, each way. The numbers in docs/parallelism.md and
docs/training.md.

Usage: python -m bench.sequence_shard_memory
"""

from bench.published_runs import LLAMA3_ROWS
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.planner.stage_costs import microbatch_pieces

KEY = "--parallelism.sequence_parallel_save_shard"
RECOMPUTE = "--activation_checkpoint.recompute_mlp_activation"


def main() -> None:
    run = LLAMA3_ROWS[0].choices(126)[0]  # 405B's 126 layers; the first of the row's layouts
    without = [arg for arg in run.argv() if arg not in (KEY, RECOMPUTE)]  # the row itself sets both
    ways = {"without it": without, "with the key": [*without, KEY], "with it and the MLP's activation recomputed": [
        *without, KEY, RECOMPUTE]}
    for name, argv in ways.items():
        block = microbatch_pieces(parse_args(JobConfig, argv), 1).block
        print(f"{name}: saved {block.saved_bytes / 2**20:,.1f} MiB, transient {block.transient_bytes / 2**20:,.1f} MiB")


if __name__ == "__main__":
    main()
