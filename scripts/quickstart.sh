#!/usr/bin/env bash
# Installs the CPU requirements and trains a LoRA on the built-in tiny SD 1.x model and the example data.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -r requirements.txt -c constraints-cpu.txt
export HF_HUB_OFFLINE=1
exec python train_network.py --config_file examples/quickstart_sd.toml "$@"
