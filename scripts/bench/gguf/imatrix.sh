#!/usr/bin/env bash
# GGUF quality with and without an importance matrix (benchmark, not a test), on the
# trained tiny Llama of `make oracle` (scripts/oracle/train_tiny_llama.py: its calib.jsonl for calibration,
# its eval.txt — held-out files — for perplexity). Every perplexity is llama.cpp's own llama-perplexity
# (Debian sid llama.cpp 0.7.0, scripts/gguf/llamacpp-root.sh) on eval.txt:
#   F16            our GGUF_TYPE=F16 file (also the input of llama-quantize and llama-imatrix)
#   lq             llama-quantize F16 -> TYPE
#   lq+imatrix     llama-imatrix on calib.jsonl's texts (joined), then llama-quantize --imatrix
#   ours           flexinfer-worker quantize FORMAT=GGUF GGUF_TYPE=TYPE (no DATASET: no importance)
#   ours+pass      the same with DATASET=calib.jsonl: the importance matrix of our own calibration pass
#                  (GGUF_GPTQ=0: every value rounded on its own)
#   ours+pass+gptq the same with GGUF_GPTQ=1: GPTQ error feedback on the K-quant grids
# and the wall times of ours+pass and ours+pass+gptq (one process each: pass + quantize + write) against
# llama-imatrix + llama-quantize --imatrix (two processes; the F16 conversion they need is not counted),
# with the load.
# Usage: scripts/bench/gguf/imatrix.sh [TYPE...]   (default Q4_K_M Q3_K_M Q2_K; the timing uses the first)
# Env: SKIP_PPL=1 (timing only), VARIANTS (the perplexity columns to run, default
#      "f16 lq lqi ours ourspass oursgptq"; e.g. VARIANTS="ourspass oursgptq" after a change to the feedback),
#      SKIP_TIME=1 (perplexities only), TIME_RUNS (3), BENCH_PROFILE (release), LOWBIT_MODEL (default ~/.cache/flexinfer/lowbit-model), CTX (512: llama-imatrix chunks,
#      llama-perplexity context and our MAX_SEQ_LEN), PPL_CHUNKS (-1: all of eval.txt), THREADS (nproc).
set -euo pipefail
cd "$(dirname "$0")/../../.."
TYPES=("$@"); [ ${#TYPES[@]} -gt 0 ] || TYPES=(Q4_K_M Q3_K_M Q2_K)
MODEL=${LOWBIT_MODEL:-$HOME/.cache/flexinfer/lowbit-model}
CTX=${CTX:-512} PPL_CHUNKS=${PPL_CHUNKS:--1} THREADS=${THREADS:-$(nproc)}
[ -f "$MODEL/model.safetensors" ] && [ -f "$MODEL/calib.jsonl" ] && [ -f "$MODEL/eval.txt" ] ||
  { echo "no trained model in $MODEL: run make oracle (scripts/oracle/train_tiny_llama.py)" >&2; exit 2; }
TARGET="${CARGO_TARGET_DIR:-target}"
# BENCH_PROFILE=dev uses the dev build (dependencies at opt-level 2, flexinfer-quant at 3) instead of release.
PROFILE=${BENCH_PROFILE:-release}
cargo build -j"${BENCH_JOBS:-2}" --profile "$PROFILE" -p flexinfer-worker >&2
[ "$PROFILE" = dev ] && PDIR=debug || PDIR=$PROFILE
BIN=$(cd "$TARGET/$PDIR" && pwd)/flexinfer-worker
ROOT=$(bash scripts/gguf/llamacpp-root.sh)
W=$(mktemp -d "${TMPDIR:-/tmp}/imatrix-bench.XXXXXX"); trap 'rm -rf "$W"' EXIT
N_SAMPLES=$(wc -l < "$MODEL/calib.jsonl")
python3 -c 'import json,sys; print("\n\n".join(json.loads(l)["text"] for l in open(sys.argv[1]) if l.strip()))' \
  "$MODEL/calib.jsonl" > "$W/calib.txt"
cp "$MODEL/eval.txt" "$W/eval.txt"
load() { cut -d' ' -f1-3 /proc/loadavg; }
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); model $MODEL;" \
     "calibration $N_SAMPLES samples, ctx $CTX; llama.cpp threads $THREADS"
lc() { bash scripts/gguf/llamacpp-run.sh "$ROOT" "$W" "$@"; }
now() { date +%s.%N; }
# ours NAME TYPE [DATASET [GGUF_GPTQ]]: the worker's GGUF artifact, copied to $W/NAME.gguf; prints the wall time.
ours() {
  local name=$1 ty=$2 ds=${3:-} fb=${4:-0} t0
  t0=$(now)
  env FORMAT=GGUF GGUF_TYPE="$ty" DATASET="$ds" GGUF_GPTQ="$fb" MAX_SAMPLES="$N_SAMPLES" MAX_SEQ_LEN="$CTX" FLEXINFER_TELEMETRY=false \
    "$BIN" quantize --model-dir "$MODEL" --out-dir "$W/run-$name/out" > "$W/$name.log" 2>&1 ||
    { cat "$W/$name.log" >&2; exit 1; }
  echo "$(now) - $t0" | bc
  cp "$W/run-$name/out/model-$ty.gguf" "$W/$name.gguf"; rm -rf "$W/run-$name"
}
# ppl FILE: llama-perplexity's final estimate (retried: the tool may exit before its log thread prints it).
ppl() {
  local v=""
  for _ in 1 2 3; do
    v=$(lc llama-perplexity -m "$1" -f eval.txt -c "$CTX" -b "$CTX" -t "$THREADS" --chunks "$PPL_CHUNKS" 2>&1 |
        sed -n 's/.*Final estimate: PPL = \([0-9.]*\) +\/- \([0-9.]*\).*/\1 ± \2/p')
    [ -n "$v" ] && break
  done
  echo "${v:-n/a}"
}

VARIANTS=" ${VARIANTS:-f16 lq lqi ours ourspass oursgptq} "
want() { [[ "$VARIANTS" == *" $1 "* ]]; }
ours F16 F16 > /dev/null
[ "${SKIP_PPL:-0}" = 1 ] || ! want f16 || echo "F16: ppl $(ppl F16.gguf)"
if [ "${SKIP_TIME:-0}" != 1 ] || want lqi; then
  lc llama-imatrix -m F16.gguf -f calib.txt -c "$CTX" -t "$THREADS" -o imatrix.gguf > "$W/imatrix.log" 2>&1 ||
    { tail -20 "$W/imatrix.log" >&2; exit 1; }
fi
if [ "${SKIP_PPL:-0}" != 1 ]; then
  for ty in "${TYPES[@]}"; do
    line="$ty: ppl"
    if want lq; then
      lc llama-quantize F16.gguf "lq-$ty.gguf" "$ty" "$THREADS" > "$W/lq.log" 2>&1 || { tail "$W/lq.log" >&2; exit 1; }
      line="$line | lq $(ppl "lq-$ty.gguf")"
    fi
    if want lqi; then
      lc llama-quantize --imatrix imatrix.gguf F16.gguf "lqi-$ty.gguf" "$ty" "$THREADS" > "$W/lqi.log" 2>&1 ||
        { tail "$W/lqi.log" >&2; exit 1; }
      line="$line | lq+imatrix $(ppl "lqi-$ty.gguf")"
    fi
    if want ours; then ours "ours-$ty" "$ty" > /dev/null; line="$line | ours $(ppl "ours-$ty.gguf")"; fi
    if want ourspass; then
      ours "ourspass-$ty" "$ty" "$MODEL/calib.jsonl" > /dev/null
      line="$line | ours+pass $(ppl "ourspass-$ty.gguf")"
    fi
    if want oursgptq; then
      ours "oursgptq-$ty" "$ty" "$MODEL/calib.jsonl" 1 > /dev/null
      line="$line | ours+pass+gptq $(ppl "oursgptq-$ty.gguf")"
    fi
    echo "$line"
    rm -f "$W"/*-"$ty".gguf
  done
fi
[ "${SKIP_TIME:-0}" != 1 ] || exit 0
# Time, alternated TIME_RUNS times on the first type: ours+pass (one process) against llama-imatrix +
# llama-quantize --imatrix (two processes, each timed), with the load average before each.
ty=${TYPES[0]}; : > "$W/ours.t"; : > "$W/theirs.t"; : > "$W/gptq.t"
median() { sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
for r in $(seq 1 "${TIME_RUNS:-3}"); do
  l1=$(load); t_ours=$(ours "ourspass-$ty" "$ty" "$MODEL/calib.jsonl")
  tokens=$(grep -o '"importanceTokens":"[0-9]*"' "$W/ourspass-$ty.log" | grep -o '[0-9]*' || true)
  l3=$(load); t_gptq=$(ours "oursgptq-$ty" "$ty" "$MODEL/calib.jsonl" 1)
  l2=$(load); t0=$(now)
  lc llama-imatrix -m F16.gguf -f calib.txt -c "$CTX" -t "$THREADS" -o imatrix.gguf > "$W/imatrix.log" 2>&1
  t1=$(now)
  lc llama-quantize --imatrix imatrix.gguf F16.gguf "lqi-$ty.gguf" "$ty" "$THREADS" > "$W/lqi.log" 2>&1
  t2=$(now)
  t_theirs=$(echo "$t2 - $t0" | bc)
  echo "$t_ours" >> "$W/ours.t"; echo "$t_theirs" >> "$W/theirs.t"; echo "$t_gptq" >> "$W/gptq.t"
  echo "$ty time run $r: ours+pass $t_ours s (load $l1; pass over ${tokens:-?} tokens) |" \
       "ours+pass+gptq $t_gptq s (load $l3) |" \
       "llama-imatrix $(echo "$t1 - $t0" | bc) s + llama-quantize --imatrix $(echo "$t2 - $t1" | bc) s = $t_theirs s (load $l2)"
done
o=$(median < "$W/ours.t"); t=$(median < "$W/theirs.t"); g=$(median < "$W/gptq.t")
echo "$ty time: median ours+pass $o s, ours+pass+gptq $g s, llama-imatrix + llama-quantize $t s," \
     "ratios $(echo "scale=2; $o / $t" | bc), $(echo "scale=2; $g / $t" | bc);" \
     "llama-imatrix: $(grep -o 'computing over [0-9]* chunks[^,]*' "$W/imatrix.log" | head -1)"
