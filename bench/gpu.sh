#!/usr/bin/env bash
# One prepared device call: torchpre and torchtitan side by side on one (or two) CUDA GPUs, Llama 3.2 1B and
# 3B shapes with the 128,256-id vocabulary, bf16, seq 4096 (8192 if the time budget allows), compiled and
# eager, a long-context row (1B at seq 32768: cp1 on one GPU, cp2 if two), FP8 rows (1B and 3B compiled, float8
# linears through torchao, rowwise and tensorwise; torchtitan 0.3.0 rowwise only), the same global batch and steps
# for both (bench/gpu_compare.py). Needs bench/wheels from `bash bench/prepare_gpu_wheels.sh` (run where there is
# network); installs them offline into /tmp.
# Writes gpu_table.md, gpu_raw.jsonl and gpu_log.txt into $OUT (or ./outputs/bench_gpu).
# Usage: bash bench/gpu.sh [--steps 15] [--budget-s 420] [--only fp8]
# CPU check of every command line: GPU_BENCH_SMOKE=1 bash bench/gpu.sh [--max-rows N] [--only fp8]; PYTHON picks
# the interpreter, GPU_BENCH_SITE the install folder.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-./outputs/bench_gpu}"
site="${GPU_BENCH_SITE:-/tmp/gpu_bench_site}"
python="${PYTHON:-python3}"
mkdir -p "$out"
[ -d bench/wheels ] || { echo "bench/wheels is missing: run 'bash bench/prepare_gpu_wheels.sh' first" >&2; exit 1; }
"$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    --find-links bench/wheels torchtitan torchdata torchao tyro docstring-parser typeguard typing-extensions \
    spmd-types torch-checkpointing
export PYTHONPATH="$PWD:$site" PYTHONUNBUFFERED=1
"$python" -c "import torch, torchtitan, torchao; print('torch', torch.__version__, \
'| torchtitan', torchtitan.__version__, '| torchao', torchao.__version__, \
'| GPUs', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
if [ "${GPU_BENCH_SMOKE:-0}" = 1 ]; then
    "$python" -m bench.gpu_compare --out "$out" --smoke "$@"
else
    "$python" -m bench.gpu_compare --out "$out" "$@"
fi
