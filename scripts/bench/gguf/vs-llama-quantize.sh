#!/usr/bin/env bash
# GGUF quantization time, ours beside llama.cpp's llama-quantize (benchmark, not a test), on the generated
# ~100M-parameter Llama (testkit SMALL_100M, BF16 safetensors, random weights), no importance matrix:
#   ours:   BF16 safetensors -> GGUF TYPE   (bench_gguf model TYPE, rayon on every core)
#   theirs: our BF16 GGUF    -> GGUF TYPE   (llama-quantize ... TYPE $(nproc), Debian sid llama.cpp 0.7.0)
# Both start from the same BF16 values (tests/gguf_llamacpp.rs shows the outputs are byte-identical).
# Alternates the two RUNS times and prints each time, the medians and their ratio, and peak RSS.
# Usage: scripts/bench/gguf/vs-llama-quantize.sh [RUNS] [TYPE...]   (default 3 runs; Q4_K_M Q8_0)
set -euo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${1:-3}; shift || true
TYPES=("$@"); [ ${#TYPES[@]} -gt 0 ] || TYPES=(Q4_K_M Q8_0)
TARGET="${CARGO_TARGET_DIR:-target}"
cargo build -j"${BENCH_JOBS:-1}" --release -p flexinfer-quant --example bench_gguf >&2
BIN=$TARGET/release/examples/bench_gguf
ROOT=$(bash scripts/gguf/llamacpp-root.sh)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load $(cut -d' ' -f1-3 /proc/loadavg)"
"$BIN" model BF16 "$W" >/dev/null
median() { sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
rss() { grep 'Maximum resident' "$1" | awk '{printf "%.0f", $NF/1024}'; }
for ty in "${TYPES[@]}"; do
  : > "$W/ours.t"; : > "$W/theirs.t"
  for r in $(seq 1 "$RUNS"); do
    /usr/bin/time -v "$BIN" model "$ty" > "$W/ours.out" 2> "$W/ours.time"
    awk -v t="$ty" '{for(i=1;i<=NF;i++) if($i==t":") {print $(i+1); exit}}' "$W/ours.out" >> "$W/ours.t"
    t0=$(date +%s.%N)
    /usr/bin/time -v bash scripts/gguf/llamacpp-run.sh "$ROOT" "$W" \
      llama-quantize model-BF16.gguf "lq-$ty.gguf" "$ty" "$(nproc)" > "$W/lq.log" 2> "$W/theirs.time"
    echo "$(date +%s.%N) - $t0" | bc >> "$W/theirs.t"
    echo "$ty run $r: ours $(tail -1 "$W/ours.t") s (read safetensors, quantize, write), llama-quantize $(tail -1 "$W/theirs.t") s (process wall: read GGUF, quantize, write)"
  done
  o=$(median < "$W/ours.t"); t=$(median < "$W/theirs.t")
  echo "$ty: median ours $o s, llama-quantize $t s, ours/llama-quantize $(echo "scale=2; $o / $t" | bc);" \
       "peak RSS ours $(rss "$W/ours.time") MiB (the process also generates the model), llama-quantize $(rss "$W/theirs.time") MiB;" \
       "ours: $(cat "$W/ours.out"); llama-quantize's file $(du -b "$W/lq-$ty.gguf" | cut -f1) bytes"
done
