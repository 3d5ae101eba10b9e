#!/usr/bin/env bash
# Smoke test of the CUDA + NCCL path on one GPU: trains the debug model and a 1B step or two.
# Usage: bash scripts/gpu_smoke.sh [LOG_DIR]   (prints the step logs; writes metrics under LOG_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-./outputs/gpu_smoke}"
mkdir -p "$out"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
python3 train.py --job.config_file train_configs/debug_model.toml --training.steps 60 \
    --job.dump_folder "$out/debug" 2>&1 | grep -E "step |model|error"
python3 train.py --model.flavor 1B --training.seq_len 2048 --training.local_batch_size 2 --training.steps 4 \
    --training.mixed_precision_param bfloat16 --metrics.log_freq 1 --lr_scheduler.warmup_steps 1 --job.dump_folder "$out/1B" 2>&1 | grep -E "step |model|error"
