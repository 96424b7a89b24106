#!/usr/bin/env bash
# Issue 28's GPU set in one bounded call: SDXL and FLUX.1-dev LoRA at 1024², bf16 autocast, full-size random
# weights, through the real trainer (bench/bench_gpu_lora.py: s/step, TFLOP/s, MFU, peak VRAM), with and without
# the speed-ups that apply on a GPU. Each run gets what is left of the budget; the table so far is in
# $OUT/gpu_set.md after every run, the runs' whole output in $OUT/gpu_set.log (the device tool returns at most
# 8 files from $OUT), so a run stopped at the limit still leaves the rows before it.
#
#   bash bench/gpu_set.sh                # on the GPU machine (docs/performance.md: how to carry the wheels)
#   bash bench/gpu_set.sh --smoke        # the same runs on tiny presets, on the CPU: checks the script itself
#
# GPU_SET_SECONDS (default 540) is the budget; OUT (default bench/gpu_set_out) where the two files go.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-bench/gpu_set_out}
BUDGET=${GPU_SET_SECONDS:-540}
mkdir -p "$OUT"
END=$(( $(date +%s) + BUDGET ))
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if compgen -G ".whl/*.whl" > /dev/null; then  # packages the GPU machine lacks (diffusers, ...), carried as wheels
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if [ "${1:-}" = "--smoke" ]; then
    SDXL=(--preset tiny:sdxl --resolution 64 --steps 3 --mixed_precision no)
    FLUX=(--preset tiny:flux --resolution 64 --steps 3 --mixed_precision no)
    SWAP=1
else
    SDXL=(--preset random:sdxl --resolution 1024 --steps 10)
    FLUX=(--preset random:flux-dev --resolution 1024 --steps 10)
    SWAP=18
fi

TABLE="$OUT/gpu_set.md"
LOG="$OUT/gpu_set.log"
: > "$LOG"
{
    echo "# GPU set ($(date -u +%FT%TZ))"
    echo
    "$PYTHON" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU')" 2>&1
    echo
    echo "| run | trainer flags | step | TFLOP/step | peak VRAM | rc |"
    echo "|---|---|---|---|---|---|"
} > "$TABLE"

run() {  # name, bench_gpu_lora.py arguments (trainer flags after --)
    local name=$1
    shift
    local left=$(( END - $(date +%s) ))
    if [ "$left" -lt 60 ]; then
        echo "| $name | | skipped: the budget is spent | | | |" >> "$TABLE"
        return
    fi
    echo "=== $name: bench/bench_gpu_lora.py $*" >> "$LOG"
    local output rc
    output=$(timeout "$left" "$PYTHON" bench/bench_gpu_lora.py "$@" 2>&1)
    rc=$?
    printf '%s\n' "$output" | tr '\r' '\n' | grep -v -E '(it/s|s/it)' >> "$LOG"
    local step flops vram extra
    step=$(printf '%s\n' "$output" | sed -n 's/^step: \(.*\); [0-9.]* TFLOP per step$/\1/p' | tail -1)
    flops=$(printf '%s\n' "$output" | sed -n 's/^step: .*; \([0-9.]*\) TFLOP per step$/\1/p' | tail -1)
    vram=$(printf '%s\n' "$output" | sed -n 's/^peak VRAM: \([0-9.]*\) GiB allocated.*/\1 GiB/p' | tail -1)
    extra=$(printf '%s' "$*" | sed -n 's/.* -- \(.*\)/\1/p')
    echo "| $name | ${extra:--} | ${step:-failed, see gpu_set.log} | ${flops:--} | ${vram:--} | $rc |" >> "$TABLE"
}

run sdxl "${SDXL[@]}"
run sdxl_no_fused_lora "${SDXL[@]}" -- --no_fused_lora
run sdxl_no_channels_last "${SDXL[@]}" -- --no_channels_last
run flux "${FLUX[@]}"
run flux_no_fused_lora "${FLUX[@]}" -- --no_fused_lora
run flux_block_swap "${FLUX[@]}" -- --blocks_to_swap "$SWAP"
run sdxl_attention_checkpointing "${SDXL[@]}" -- --gradient_checkpointing_policy attention
run flux_attention_checkpointing "${FLUX[@]}" -- --gradient_checkpointing_policy attention
cat "$TABLE"
