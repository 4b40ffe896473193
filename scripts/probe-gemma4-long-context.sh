#!/usr/bin/env bash
# Long-context readiness probe (the promotion gate's input): short sanity, medium and long retention of a
# verification code; JSON + Markdown report; non-zero exit on garbage, repetition or a wrong answer. Not specific
# to Gemma 4: any model behind an OpenAI-compatible endpoint. Settings (ENDPOINT, MODEL, AUTH_TOKEN, POD_SELECTOR,
# LONG_TOKENS, …): scripts/probe/long_context.py.
exec python3 "$(dirname "$0")/probe/long_context.py" "$@"
