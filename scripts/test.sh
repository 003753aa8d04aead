#!/usr/bin/env bash
# The whole test suite, as CI runs it: bootstrap .venv, then pytest on 4 workers
# (the multi-process tests put every worker on one pool file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -n 4 "$@"
