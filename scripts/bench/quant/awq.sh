#!/usr/bin/env bash
# AWQ 4-bit g128 on the TRAINED tiny Llama (not a test), side by side in one run: ours (examples/awq_dir) and the
# peer, GPTQModel's AWQ (scripts/oracle/gptqmodel_quantize.py --awq), each RUNS times, alternating; then held-out
# perplexity and KL to f32 (scripts/oracle/lowbit_eval.py) of each artifact, of f32 and of symmetric RTN w4.
# Wall and CPU (user+sys) seconds and peak RSS from /usr/bin/time; the machine's load before each run.
# Usage: scripts/bench/quant/awq.sh [RUNS] (default 3). Needs the oracle venv with gptqmodel (see Makefile).
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${1:-3}
PY="${ORACLE_PYTHON:-$HOME/.cache/flexinfer/oracle-venv/bin/python}"
MODEL="${LOWBIT_MODEL:-$HOME/.cache/flexinfer/lowbit-model}"
OUT="${AWQ_BENCH_OUT:-$HOME/.cache/flexinfer/awq-bench}"
TARGET="${CARGO_TARGET_DIR:-target}"
[ -f "$MODEL/model.safetensors" ] || "$PY" scripts/oracle/train_tiny_llama.py "$MODEL"
cargo build -j1 -p flexinfer-quant --example awq_dir
BIN="$TARGET/debug/examples/awq_dir"
mkdir -p "$OUT"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
measure() { # label, command...
  local label=$1; shift
  local load; load=$(cut -d' ' -f1 /proc/loadavg)
  /usr/bin/time -f '%e %U %S %M' -o "$OUT/$label.time" "$@" > "$OUT/$label.log" 2>&1
  read -r wall user sys rss < "$OUT/$label.time"
  echo "{\"run\": \"$label\", \"wall_s\": $wall, \"cpu_s\": $(echo "$user + $sys" | bc), \"peak_rss_mib\": $((rss / 1024)), \"load_before\": $load}"
}
for i in $(seq "$RUNS"); do
  rm -rf "$OUT/ours" "$OUT/gptqmodel"
  measure "ours-$i" "$BIN" "$MODEL" "$OUT/ours" "$MODEL/calib.jsonl" 128 128 256
  # GPTQModel writes a logs/ folder into its working directory: run it in $OUT, not in the repository.
  measure "gptqmodel-$i" env -C "$OUT" "$PY" "$PWD/scripts/oracle/gptqmodel_quantize.py" "$MODEL" "$OUT/gptqmodel" 4 --awq
done
"$PY" scripts/oracle/lowbit_eval.py "$MODEL" --label fp32 2>/dev/null | tail -1
"$PY" scripts/oracle/lowbit_eval.py "$MODEL" --rtn 4 --label rtn-w4-sym 2>/dev/null | tail -1
"$PY" scripts/oracle/lowbit_eval.py "$MODEL" --awq "$OUT/ours" --label ours-awq-w4 2>/dev/null | tail -1
"$PY" scripts/oracle/lowbit_eval.py "$MODEL" --awq "$OUT/gptqmodel" --label gptqmodel-awq-w4 2>/dev/null | tail -1
