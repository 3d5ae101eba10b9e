#!/usr/bin/env bash
# Run HERE, with network, before a device call: downloads into bench/wheels (git-ignored) the wheels that bench/gpu.sh
# installs offline on the GPU machine, whose Python (3.12, torch 2.11) lacks them: torchtitan 0.3.0 (the newest release;
# its metadata pins no torch, its torch-checkpointing asks for torch >= 2.11; whether its trainer runs on torch 2.11
# only the device call can tell, as this machine has torch 2.14.1: `python -m bench.titan_llama --check` runs here),
# its spmd-types and torch-checkpointing, torchdata, its config parser tyro with docstring-parser and typeguard, and
# typing-extensions (tyro needs >= 4.14; a newer one only adds names), all pure Python (about 2 MB), and torchao 0.18
# for the FP8 rows (both frameworks' float8 linears; its compiled extensions load on torch >= 2.11, and the float8
# matmul is torch's own `_scaled_mm`). The rest of what torchpre and torchtitan import is installed there (numpy,
# safetensors, tiktoken, regex, tqdm, tokenizers, tensorboard, fsspec, einops, pillow); Hugging Face `datasets` is not
# needed (bench/titan_llama.py feeds synthetic tokens and stubs the import). flash-attn has no wheel on PyPI (source
# only, a CUDA build), so both frameworks use SDPA, which picks its flash kernel for bf16 causal attention.
# Usage: bash bench/prepare_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")"
rm -rf wheels && mkdir wheels
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --dest wheels \
    torchtitan==0.3.0 spmd-types==0.2.3 torch-checkpointing==0.1.1 torchdata==0.11.0 torchao==0.18.0 tyro==1.0.17 \
    docstring-parser==0.18.0 typeguard==4.6.1 typing-extensions==4.16.0
ls -l wheels
du -sh wheels
