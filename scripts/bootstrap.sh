#!/usr/bin/env bash
# Create or refresh .venv with exactly the pinned packages, then install this
# project into it. Safe to run repeatedly: it does nothing when the pins did
# not change. sglang is installed without its CUDA dependency tree (see
# requirements.txt); constraints.txt keeps torch/torchvision at the pair it pins.
set -euo pipefail
cd "$(dirname "$0")/.."
# SGLang's HiCache hashes pages with a C++ extension (mem_cache/cpp_utils/native_hash.py) that torch
# builds at first use, with no fallback: the demo's servers and the tests need g++, ninja and libcrypto.
if ! command -v g++ >/dev/null || ! command -v ninja >/dev/null || [ ! -e /usr/include/openssl/sha.h ]; then
    echo "bootstrap: installing g++, ninja-build and libssl-dev (SGLang's page-hash extension)" >&2
    apt-get update -qq && apt-get install -y -qq g++ ninja-build libssl-dev
fi
PY=${PYTHON:-python3}
VENV=.venv
stamp="$VENV/.maru-shm-pins"
want=$(cat requirements.txt constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "bootstrap: installing pinned packages into $VENV (first run takes a few minutes)" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet --no-deps -r requirements.txt -c constraints.txt
    "$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .
    echo "$want" > "$stamp"
fi
