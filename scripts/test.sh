#!/usr/bin/env bash
# The whole test suite, as CI runs it: bootstrap .venv, then pytest on 4 workers
# (the multi-process tests put every worker on one pool file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# tests/tools/test_cli.py drives `maru-shm inspect/watch` in a real terminal (tmux)
command -v tmux >/dev/null || (apt-get update -qq && apt-get install -y -qq tmux)
# tests/maru_sglang/test_tier2.py runs a real Mooncake Store (maru_tier2), whose wheel links libibverbs.so.1
ldconfig -p | grep -q 'libibverbs\.so\.1 ' || (apt-get update -qq && apt-get install -y -qq libibverbs1)
exec .venv/bin/python -m pytest -n 4 "$@"
