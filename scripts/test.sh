#!/usr/bin/env bash
# Installs what the tests need (CPU PyTorch pinned) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -r requirements-dev.txt -c constraints-cpu.txt
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest "$@"
