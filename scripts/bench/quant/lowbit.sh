#!/usr/bin/env bash
# GPTQ at 4, 3 and 2 bits on a TRAINED model (not a test): held-out perplexity and KL to f32 of the
# tiny Llama of scripts/oracle/train_tiny_llama.py (trained first when missing), quantized g128 symmetric by
#   - round-to-nearest (scripts/oracle/lowbit_eval.py --rtn)
#   - the engine through the worker CLI (flexinfer-worker quantize, GPTQ_DEVICE=cpu), once per knob setting
#   - GPTQModel with its defaults (scripts/oracle/gptqmodel_quantize.py), when LOWBIT_GPTQMODEL=1
# Usage: scripts/bench/quant/lowbit.sh [BITS...]   (default 4 3 2); WORKER=path skips the build; LOWBIT_CONFIGS
# lists name:actGroupAware:clipSearch:dampPercent[:refineScales] settings (default below). Results: one JSON line per run in
# $LOWBIT_OUT/results.jsonl (~/.cache/flexinfer/lowbit-out), also printed.
# Needs the oracle venv (torch, transformers, tokenizers, safetensors; gptqmodel for the peer), see Makefile.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${ORACLE_PYTHON:-$HOME/.cache/flexinfer/oracle-venv/bin/python}"
MODEL="${LOWBIT_MODEL:-$HOME/.cache/flexinfer/lowbit-model}"
OUT="${LOWBIT_OUT:-$HOME/.cache/flexinfer/lowbit-out}"
TARGET="${CARGO_TARGET_DIR:-target}"
PROFILE="${BENCH_PROFILE:-dev}"
BITS=("${@:-4 3 2}")
read -r -a BITS <<< "${BITS[*]}"
# name:act_group_aware:clip_search:damp_percent[:refine_scales]
CONFIGS="${LOWBIT_CONFIGS:-plain:false:off:0.05 gar:true:off:0.05 clip:false:on:0.05 gar+clip:true:on:0.05 plain-d0.01:false:off:0.01 gar+clip-d0.01:true:on:0.01}"

if [ ! -f "$MODEL/model.safetensors" ]; then
  "$PY" scripts/oracle/train_tiny_llama.py "$MODEL"
fi
# The dev profile builds the engine optimised (Cargo.toml: opt-level 3 for flexinfer-quant, 2 for deps).
if [ -n "${WORKER:-}" ]; then
  :
elif [ "$PROFILE" = "release" ]; then
  cargo build -j1 --release -p flexinfer-worker
  WORKER="$TARGET/release/flexinfer-worker"
else
  cargo build -j1 -p flexinfer-worker
  WORKER="$TARGET/debug/flexinfer-worker"
fi
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load $(cut -d' ' -f1-3 /proc/loadavg)"
record() { echo "$1" | tee -a "$RESULTS"; }
record "$("$PY" scripts/oracle/lowbit_eval.py "$MODEL" --label fp32 2>/dev/null | tail -1)"
for b in "${BITS[@]}"; do
  record "$("$PY" scripts/oracle/lowbit_eval.py "$MODEL" --rtn "$b" --label "rtn-w$b" 2>/dev/null | tail -1)"
  for cfg in $CONFIGS; do
    IFS=: read -r name gar clip damp refine <<< "$cfg"
    dir="$OUT/w$b-$name"
    rm -rf "$dir"
    start=$(date +%s.%N)
    FLEXINFER_TERMINATION_LOG="$OUT/w$b-$name.termination" GPTQ_DEVICE=cpu GPTQ_RESUME_LAYERS=false \
      "$WORKER" quantize --model-dir "$MODEL" --out-dir "$dir" \
      --bits "$b" --group-size 128 --dataset "$MODEL/calib.jsonl" --max-samples 128 --max-seq-len 256 \
      --act-group-aware "$gar" --clip-search "$clip" --damp-percent "$damp" \
      --refine-scales "${refine:-auto}" > "$OUT/w$b-$name.log" 2>&1
    secs=$(echo "$(date +%s.%N) - $start" | bc)
    recov=$(grep -c '"hessian_recovery"' "$OUT/w$b-$name.log" || true)
    line=$("$PY" scripts/oracle/lowbit_eval.py "$MODEL" --gptq "$dir" --label "ours-w$b-$name" 2>/dev/null | tail -1)
    record "${line%\}}, \"quantize_seconds\": $secs, \"hessian_recovery_events\": $recov, \"damp\": $damp, \"refine_scales\": \"${refine:-auto}\"}"
  done
  if [ "${LOWBIT_GPTQMODEL:-0}" = "1" ]; then
    dir="$OUT/w$b-gptqmodel"
    rm -rf "$dir"
    # From $OUT: GPTQModel writes a logs/ directory into its working directory.
    (cd "$OUT" && "$PY" "$OLDPWD/scripts/oracle/gptqmodel_quantize.py" "$MODEL" "$dir" "$b") \
      > "$OUT/w$b-gptqmodel.log" 2>&1
    secs=$(grep '^{"gptqmodel_seconds"' "$OUT/w$b-gptqmodel.log" | tail -1 | sed 's/.*"gptqmodel_seconds": \([0-9.]*\).*/\1/')
    line=$("$PY" scripts/oracle/lowbit_eval.py "$MODEL" --gptq "$dir" --label "gptqmodel-w$b" 2>/dev/null | tail -1)
    record "${line%\}}, \"quantize_seconds\": ${secs:-null}}"
  fi
done
