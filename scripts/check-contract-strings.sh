#!/usr/bin/env bash
# Every string constant of the controller/worker contract (crates/flexinfer-contract) is spelled
# once in production code: in the contract crate. Anywhere else it must be used by name.
#
# Production code = crates/*/src/**/*.rs outside the contract crate, without test files
# (tests.rs, *_tests.rs, tests/ and testkit) and without the `#[cfg(test)]` module at the end of
# a file. Tests may spell contract strings: they pin the wire format from the outside.
# A line may opt out with a `// not-contract: <why>` comment (e.g. a binary name that happens to
# equal the field manager). Values too generic to be told apart from unrelated code ("true", "http", …) are listed in
# GENERIC below and skipped (GGUF, GPTQ, FP8, COMPRESSED_TENSORS and AWQ, the FORMAT values, are also the API's format names and a file magic).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"

GENERIC='^(true|false|passed|failed|http|server|gpu|start|progress|complete|error|warning|download|source|abliterate|quantize|publish|abliteration|quantization|dedicated|NoSchedule|flexinfer|overwrite|timestamp|layers|/cache|/models|abliterated|\.partial|FORMAT|GGUF|GPTQ|FP8|COMPRESSED_TENSORS|AWQ)$'

# `pub const NAME: &str = "value";` in the contract crate, tests excluded.
values=$(for f in crates/flexinfer-contract/src/*.rs; do
  awk '/^#\[cfg\(test\)\]/{exit} {print}' "$f"
done | sed -n 's/^ *pub const [A-Z0-9_]*: &str = "\([^"]*\)";.*/\1/p' | sort -u)

prod_files=$(find crates -path crates/flexinfer-contract -prune -o -path '*/src/*' -name '*.rs' -print \
  | grep -v -e '/tests\.rs$' -e '_tests\.rs$' -e '/tests/' -e '/testkit' | sort)

fail=0
checked=0
for v in $values; do
  if [[ $v =~ $GENERIC ]]; then continue; fi
  checked=$((checked + 1))
  hits=$(for f in $prod_files; do
    awk -v f="$f" -v needle="\"$v\"" '/^#\[cfg\(test\)\]/{exit} /not-contract:/{next} index($0, needle){print f":"NR": "$0}' "$f"
  done)
  if [[ -n $hits ]]; then
    echo "contract string \"$v\" is retyped outside crates/flexinfer-contract (use the constant):"
    echo "$hits" | sed 's/^/  /'
    fail=1
  fi
done
if [[ $fail -ne 0 ]]; then exit 1; fi
echo "contract strings: $checked checked, each spelled only in crates/flexinfer-contract"
