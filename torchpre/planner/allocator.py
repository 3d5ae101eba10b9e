"""Memory as the CUDA caching allocator reserves it, from the tensor bytes the dry run counts.

What a GPU run reports as its peak (`torch.cuda.max_memory_reserved`, torchtitan's and torchpre's memory figure) is
the segments the caching allocator holds, not the tensors in them: blocks rounded up (to 512 B, and large ones
within 2 MiB segments' rounding), segments split and kept cached after their tensors are freed (fragmentation: a
freed block serves only requests that fit it), and the workspaces of NCCL and cuBLAS. Their sum grows with the
churn of the step's allocations, which scales with its tensor peak, so it is modelled as a fraction of it.

A compiled block (torch.compile's min-cut partitioner) saves fewer tensors for backward than the eager block the
dry run counts: `COMPILED_SAVED_KEPT` of what it saves beyond its input, by activation checkpointing mode. Under
full checkpointing a block saves its input only, which compile cannot shrink, but the one block recomputed in backward
keeps what the compiled block keeps: `COMPILED_SAVED_KEPT["none"]` of the eager recomputation's tensors
(`torchpre.planner.stage_costs._recompute_kept`).
"""

# Reserved over tensor peak, less 1: calibrated (one number for every layout) against torchtitan's published
# Llama 3.1 8B rows on H100 (benchmarks/llama3_h100_202412_torchtitan.md, tables 1-3, eager and compiled, FSDP 8 and
# 128, CP 1-8: reserved / counted tensor peak 1.168-1.186, mean 1.180, on the six rows where compile does not change
# the saved activations, eager per-op AC and full AC; 1.16-1.18, mean 1.169, while the probe counted torch's RMSNorm
# as CPU's decomposition keeps it): bench/plan_vs_published.py.
FRAGMENTATION = 0.18
# Per-op checkpointing ("selective"): calibrated on table 1's eager and compiled rows (5.4 GiB less reserved with
# compile; table 3's 128-GPU pair: 5.0). None: measured, a Llama 3 block's saved tensors counted by a saved-tensors
# hook, eager (torch's RMSNorm as the probe runs it, CUDA's fused kernel: `activation_probe.cuda_rms_norm`) and under
# torch.compile on CPU (tests/unit/test_compiled_memory.py; Inductor decomposes the norm on a GPU too): the eager
# block saves ~38 bytes per token and unit of width beyond its input (the second norm's bf16 input and statistics,
# SwiGLU's three products), the compiled one ~32 (the norms' bf16 outputs and statistics, attention's q, k, v,
# output, SwiGLU's w1, w3 outputs and their product, not the third): 0.83-0.84 over widths 256-512, MHA and GQA,
# SwiGLU of 3h and 4h (0.59-0.63 against the decomposed norm's fp32 copies, 52 bytes, which the probe counted before).
COMPILED_SAVED_KEPT = {"selective": 0.83, "none": 0.83}


def reserved_bytes(tensor_bytes: float) -> int:
    """The allocator's reserved peak for a step whose tensors peak at `tensor_bytes`."""
    return round(tensor_bytes * (1 + FRAGMENTATION))
