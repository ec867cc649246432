#!/usr/bin/env bash
# Build Horovod 0.28.1 (the last release, published as an sdist only) into a wheel, cache it, and
# install it into the project's venv. Later runs reuse the cached wheel and take seconds.
#
# Why a script: Horovod 0.28.1 pins C++14 in its CMake files, and torch >= 2.1 headers need C++17,
# so `pip install horovod` fails against the torch we use. We patch CMAKE_CXX_STANDARD to 17 in
# CMakeLists.txt and horovod/torch/CMakeLists.txt and build from that.
#
# Default build (this machine, CI): PyTorch only, Gloo controller and CPU collectives, no MPI,
# no CUDA -- about 3 minutes on 2 cores (175 s measured on the development machine).
#
# GPU cluster build (NCCL): run with, for example,
#   HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME=/usr/local/nccl HOROVOD_CUDA_HOME=/usr/local/cuda \
#   HOROVOD_WITH_MPI=1 bash scripts/build_horovod.sh
# Any HOROVOD_* variable set in the environment overrides the defaults below, and the variables
# that shape the build are part of the cache key, so a GPU wheel never shadows a CPU one.
#
# Environment:
#   VENV                 venv to install into (default: .venv)
#   DAD_WHEEL_CACHE      wheel cache (default: ~/.cache/dad-integrations/wheels)
#   HOROVOD_BUILD_JOBS   parallel compile jobs (default: number of CPUs)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
HOROVOD_VERSION=0.28.1
CACHE=${DAD_WHEEL_CACHE:-$HOME/.cache/dad-integrations/wheels}

if [ ! -x "$PY" ]; then
    echo "build_horovod: $PY not found; run scripts/setup_env.sh first" >&2
    exit 1
fi

# An installed build counts only if it has what is asked for: a CPU build must not satisfy a
# request for NCCL (the cached GPU wheel, if any, is then installed over it below).
WANT_NCCL=$([ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ] && echo 1 || echo 0)
if "$PY" -c "import horovod, horovod.torch as h; assert horovod.__version__ == '$HOROVOD_VERSION'; assert h.gloo_built(); assert not $WANT_NCCL or h.nccl_built()" 2>/dev/null; then
    echo "build_horovod: horovod $HOROVOD_VERSION (torch, gloo) already installed in $VENV"
    exit 0
fi

# Defaults for a CPU/Gloo build; the caller's environment wins.
export HOROVOD_WITH_PYTORCH=${HOROVOD_WITH_PYTORCH:-1}
export HOROVOD_WITHOUT_TENSORFLOW=${HOROVOD_WITHOUT_TENSORFLOW:-1}
export HOROVOD_WITHOUT_MXNET=${HOROVOD_WITHOUT_MXNET:-1}
export HOROVOD_WITH_GLOO=${HOROVOD_WITH_GLOO:-1}
if [ -z "${HOROVOD_WITH_MPI:-}" ]; then export HOROVOD_WITHOUT_MPI=${HOROVOD_WITHOUT_MPI:-1}; fi
if [ -z "${HOROVOD_GPU_OPERATIONS:-}" ]; then export HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-GLOO}; fi
export MAKEFLAGS="-j${HOROVOD_BUILD_JOBS:-$(nproc)}"

TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
BUILD_KEY=$(env | grep -E '^HOROVOD_(WITH|WITHOUT|GPU|CPU|NCCL|CUDA)' | sort | { cat; echo "torch=$TORCH_VERSION"; } | sha256sum | cut -c1-12)
WHEEL_DIR="$CACHE/horovod-$HOROVOD_VERSION-$BUILD_KEY"

if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    echo "build_horovod: building horovod $HOROVOD_VERSION (key $BUILD_KEY, torch $TORCH_VERSION); takes minutes"
    start=$(date +%s)
    # cmake 4 refuses the cmake_minimum_required of the bundled Gloo; 3.x builds it as is
    "$PY" -m pip install -q "cmake>=3.13,<4" wheel setuptools packaging psutil pyyaml cloudpickle
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
    # No build isolation: the extension must compile against the venv's torch.
    PATH="$(cd "$VENV/bin" && pwd):$PATH" "$PY" -m pip wheel -q --no-build-isolation --no-deps \
        "$src" -w "$work/dist"
    mkdir -p "$WHEEL_DIR"
    cp "$work"/dist/horovod-*.whl "$WHEEL_DIR/"
    echo "build_horovod: built in $(( $(date +%s) - start )) s, cached in $WHEEL_DIR"
else
    echo "build_horovod: using cached wheel in $WHEEL_DIR"
fi

# the same version may be installed from another build (CPU vs NCCL), which pip would keep
"$PY" -m pip uninstall -q -y horovod >/dev/null 2>&1 || true
"$PY" -m pip install -q "$WHEEL_DIR"/horovod-*.whl
"$PY" -c "import horovod.torch as h; assert h.gloo_built(), 'horovod built without gloo'; print('build_horovod: horovod', __import__('horovod').__version__, 'gloo', h.gloo_built())"
