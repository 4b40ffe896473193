#!/usr/bin/env bash
# The worker built as images build it (`cargo build -p flexinfer-worker`, no dev-dependencies) has none of the
# hooks that end a run on purpose: they exist only with feature `test-hooks`, which only the tests enable.
# Checks the built binary itself: the hook flag is an unknown argument and the hook's variable and log line are
# not in it. Prints one line per check; exits non-zero on the first failure.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
cargo build -p flexinfer-worker --bin flexinfer-worker -j2 >&2
BIN=$TARGET/debug/flexinfer-worker
fail() { echo "FAIL $1"; exit 1; }
if out=$("$BIN" abliterate --test-abort-after-shards 1 2>&1); then
  fail "the production worker accepted --test-abort-after-shards"
fi
grep -q "unexpected argument '--test-abort-after-shards'" <<<"$out" \
  || fail "the production worker did not refuse --test-abort-after-shards as unknown: $out"
echo "ok   --test-abort-after-shards is an unknown argument"
for s in FLEXINFER_TEST_ABORT_AFTER_LAYER "test hook: aborting"; do
  if grep -aqF "$s" "$BIN"; then fail "the production worker contains \"$s\""; fi
  echo "ok   no \"$s\" in the binary"
done
