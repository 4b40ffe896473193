#!/usr/bin/env python3
"""One chat completion through an OpenAI-compatible endpoint with the official `openai` Python client.

Usage: openai_chat.py BASE_URL MODEL MAX_TOKENS
BASE_URL is the server's root (the script appends /v1). The request asks for exactly MAX_TOKENS tokens
(`ignore_eos`, which llama-server accepts), greedy. Prints one JSON object: the model the answer names,
the content, the finish reason and the usage. Exits 1 with the reason when the call fails. Run by
tests/tests/real_pipeline/ (the GGUF Model served by llama-server through flexinfer-proxy).
"""
import json
import sys

import openai


def main() -> int:
    base, model, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = openai.OpenAI(base_url=base.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    except openai.OpenAIError as e:
        print(f"chat completion failed: {e!r}", file=sys.stderr)
        return 1
    print(json.dumps({
        "openai_version": openai.__version__,
        "model": r.model,
        "content": r.choices[0].message.content,
        "finish_reason": r.choices[0].finish_reason,
        "usage": r.usage.model_dump() if r.usage else None,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
