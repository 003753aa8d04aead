#!/usr/bin/env bash
# The main job: two SGLang servers (launch_server, CPU) share KV pages through
# one maru_shm pool in /dev/shm (tools/demo.py). Bootstraps .venv on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -W ignore -m tools.demo "$@"
