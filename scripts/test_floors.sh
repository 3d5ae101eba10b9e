#!/usr/bin/env bash
# Checks that the version floors in pyproject.toml are true: installs torchpre on the oldest Python it supports
# with every dependency at its floor (scripts/floor_constraints.txt, setuptools too; the fp8 extra's torchao too, whose
# floor must load on the floor torch), in a fresh virtual environment, then trains the debug model for a few steps on
# 2 processes, and with FP8 linears on 1, and runs the unit tests (the FP8 ones among them).
# Usage: bash scripts/test_floors.sh [VENV_DIR]   (PYTHON=python3.10 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.10}"
VENV="${1:-$(mktemp -d)/venv}"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -c scripts/floor_constraints.txt --build-constraint scripts/floor_constraints.txt \
    -e ".[dev,fp8]"
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|torchdata|numpy|safetensors|tiktoken|tqdm|tomli|torchao) '
DUMP="$(mktemp -d)"
"$VENV/bin/torchrun" --nproc_per_node=2 train.py --job.config_file train_configs/debug_model.toml \
    --training.steps 3 --job.dump_folder "$DUMP"
"$VENV/bin/python" train.py --job.config_file train_configs/debug_model.toml --training.steps 3 \
    --quantize.linear float8 --job.dump_folder "$DUMP/fp8"
"$VENV/bin/python" -m pytest -q -n 2 tests/unit
