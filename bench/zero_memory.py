"""Bytes per parameter of the training state under ZeRO stages 0-3, measured next to the formulas.

Trains the debug model with AdamW for 2 steps per configuration (ZeRO 0-3 x dp 2, 4 x fp32/bf16 parameters)
and prints, per model parameter, the `param_bytes`, `grad_bytes` and `optimizer_state_bytes` that
metrics.jsonl reports (max over ranks), each as measured / formula. AdamW's `step` counts (one 4-byte scalar
per parameter tensor, ~0.00004 bytes per parameter here) are inside the measured state. A stage that
torchpre's config validation does not accept yet is printed as "not available".

It then projects the same formulas, which the measured rows check, onto Llama 3 70B (the released
flavor: 128,256-token vocabulary) at tp8 x dp8 with bf16 parameters: model state per GPU before activations.

Usage: python -m bench.zero_memory [--dp 2 4] [--stages 0 1 2 3]
"""

import argparse
import sys
from fractions import Fraction

import torch

from bench.common import print_table, run_torchpre
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.step_rules.zero_stages import ZERO_STAGES

NUM_PARAMS = 5_770_496  # the debug model with the shipped 2048-token tokenizer
GLOBAL_BATCH = 8
COMMON = ["--model.flavor", "debugmodel", "--training.seq_len", "32", "--training.steps", "2",
          "--training.global_batch_size", str(GLOBAL_BATCH), "--metrics.log_freq", "1", "--optimizer.name", "AdamW"]
KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
DTYPES = {"float32": 4, "bfloat16": 2}


def formula(zero_stage: int, dtype: str, dp: int) -> tuple[Fraction, Fraction, Fraction]:
    """(parameter, gradient, optimizer state) bytes per parameter on one rank, for AdamW: fp32 gradients
    and moments, and an fp32 master copy of a bf16 parameter. ZeRO-1 shards the state over dp, ZeRO-2 the
    gradients too, ZeRO-3 (FSDP2) the parameters too, which are then the fp32 masters themselves."""
    stage = ZERO_STAGES[zero_stage]
    if stage.shards_parameters:
        return Fraction(4, dp), Fraction(4, dp), Fraction(8, dp)
    param, state = Fraction(DTYPES[dtype]), Fraction(8 if dtype == "float32" else 12)
    grad = Fraction(4, dp) if stage.shards_gradients else Fraction(4)
    return param, grad, state / dp if stage.shards_optimizer_state else state


def measure(zero_stage: int, dtype: str, dp: int) -> dict[str, int]:
    args = [*COMMON, "--training.local_batch_size", str(GLOBAL_BATCH // dp), "--optimizer.zero_stage",
            str(zero_stage), "--training.mixed_precision_param", dtype]
    last = run_torchpre(args, nproc=dp)[-1]
    return {key: last[key] for key in KEYS}


def project_70b(tp: int = 8, dp: int = 8) -> list[list]:
    """Rows of (zero stage, GB of parameters + gradients + optimizer state per GPU) for Llama 3 70B at tp x dp:
    every weight matrix is TP-sharded, so a GPU holds about 1/tp of the parameters before ZeRO."""
    with torch.device("meta"):
        num_params = sum(p.numel() for p in Transformer(LLAMA3_FLAVORS["70B"]).parameters())
    local = num_params / tp
    rows = []
    for stage in (0, 1, 2, 3):
        per_param = sum(formula(stage, "bfloat16", dp))
        rows.append([stage, f"{float(per_param):.2f}", f"{local * float(per_param) / 1e9:.1f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    options = parser.parse_args()
    rows = []
    for dtype in DTYPES:
        for dp in options.dp:
            for stage in options.stages:
                expected = formula(stage, dtype, dp)
                if stage not in ZERO_STAGES:
                    cells = [f"not available / {float(e):.2f}" for e in expected]
                else:
                    measured = measure(stage, dtype, dp)
                    cells = [f"{measured[key] / NUM_PARAMS:.2f} / {float(e):.2f}" for key, e in zip(KEYS, expected)]
                total = f"{float(sum(expected)):.2f}"
                rows.append([dtype, dp, stage, *cells, total])
                print(f"{dtype} dp{dp} zero{stage}: {' | '.join(cells)}", file=sys.stderr, flush=True)
    print_table(
        f"Bytes per parameter on one rank, measured / formula (debug model, {NUM_PARAMS:,} parameters, AdamW)",
        ["params", "dp", "zero", "param_bytes", "grad_bytes", "optimizer_state_bytes", "formula total"],
        rows,
    )
    print_table(
        "Llama 3 70B at tp8 x dp8, bf16 parameters, AdamW: model state per GPU (formulas above)",
        ["zero", "bytes per local parameter", "GB per GPU"],
        project_70b(),
    )


if __name__ == "__main__":
    main()
