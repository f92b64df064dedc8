#!/usr/bin/env bash
# Make the folder the SGLang parser check imports from (tests/real_engine/test_sglang_args.py):
# SGLang itself without its dependencies (they pull CUDA builds), plus the pure-Python
# packages its server-args module needs at import; torch and numpy come from the vLLM venv
# the check runs under. Idempotent.
#   tests/real_engine/install_sglang_parser.sh [VENV]   (default: .ci-sglang-venv in the checkout)
# Then: LLMGW_SGLANG_PATH=$(tests/real_engine/install_sglang_parser.sh) ... pytest -m real_engine
# Prints the site-packages folder to put in LLMGW_SGLANG_PATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.ci-sglang-venv}"
SGLANG_VERSION="${LLMGW_SGLANG_VERSION:-0.5.23}"
# Keep pip's errors, less its warning per missing local index folder and its list of the
# SGLang dependencies left out on purpose.
quiet() { "$@" 2> >(grep -v -e "^WARNING: Location 'file://" -e "^ERROR: pip's dependency resolver" \
    -e "^sglang [0-9.]* requires" >&2) >&2; }
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -m pip show sglang >/dev/null 2>&1; then
    quiet "$VENV/bin/pip" install --quiet --no-deps "sglang==$SGLANG_VERSION" orjson
    # sglang.utils imports IPython.display at import time; IPython with its own deps.
    quiet "$VENV/bin/pip" install --quiet ipython
fi
"$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
