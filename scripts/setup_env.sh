#!/usr/bin/env bash
# Create (or update) the project's virtual environment in <repo>/.venv and install the package
# with its test, example, engine (Accelerate, DeepSpeed; Horovod built from source by
# scripts/build_horovod.sh) and docs extras. Safe to run again: existing pieces are kept.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
    PYTHON=$(command -v python3.11 || command -v python3)
    echo "setup_env: creating $VENV with $PYTHON ($("$PYTHON" --version 2>&1))"
    "$PYTHON" -m venv "$VENV"
else
    echo "setup_env: using existing $VENV ($("$VENV/bin/python" --version 2>&1))"
fi

# torch first and pinned: the CPU build of this exact version is on disk and the machine's pip
# config finds it; left to the bare 'torch>=2.1' requirement pip could fetch a multi-GB CUDA build.
echo "setup_env: installing torch==2.13.0"
"$VENV/bin/python" -m pip install -q torch==2.13.0

EXTRAS=${DAD_EXTRAS:-test,examples,accelerate,deepspeed,docs}
echo "setup_env: installing dad-integrations (editable) with extras [$EXTRAS]"
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"

# Horovod has no wheel on PyPI for this torch: build it once (minutes), then reuse the cached wheel.
# DAD_SKIP_HOROVOD=1 skips it (its tests then fail with a message saying how to build it).
if [ "${DAD_SKIP_HOROVOD:-0}" != "1" ]; then
    VENV="$VENV" bash scripts/build_horovod.sh
fi

echo "setup_env: done; torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
