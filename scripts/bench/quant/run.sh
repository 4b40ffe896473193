#!/usr/bin/env bash
# GPTQ engine benchmark (not a test): machine GEMM/Cholesky rate, then the GPTQ solve per Llama-7B module shape
# as a ratio to the FLOP lower bound. Usage: scripts/bench/quant/run.sh [runs] [OUTxIN ...]
#   scripts/bench/quant/run.sh model|hybrid|gemma4-moe [samples] [seq_len]   whole generated models
#   BENCH_MEMORY_LIMIT_MIB=N ... hybrid|gemma4-moe                             under an enforced memory limit (root)
set -euo pipefail
cd "$(dirname "$0")/../../.."
PROFILE="${BENCH_PROFILE:-release}"
TARGET="${CARGO_TARGET_DIR:-target}"
if [ "$PROFILE" = "release" ]; then
  cargo build -j2 --release -p flexinfer-quant --example bench_gptq
  BIN=$TARGET/release/examples/bench_gptq
else
  cargo build -j2 -p flexinfer-quant --example bench_gptq
  BIN=$TARGET/debug/examples/bench_gptq
fi
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "profile: $PROFILE"
/usr/bin/time -v "$BIN" "$@" 2> >(grep -E 'Maximum resident|Elapsed' >&2)
