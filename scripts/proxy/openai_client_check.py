#!/usr/bin/env python3
"""Drive flexinfer-proxy with the official `openai` Python client (PyPI), as users do.

Usage: openai_client_check.py BASE_URL API_KEY MODEL
BASE_URL is the proxy's root (the script appends /v1). Prints one JSON object with what it saw;
exits 1 with the reason on the first check that fails. Run by
crates/flexinfer-proxy/tests/proxy/routing.rs (proxy_works_with_the_official_openai_python_client).
"""
import json
import sys

import openai


def main() -> int:
    base, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=base.rstrip("/") + "/v1", api_key=key, max_retries=0, timeout=30)
    seen = {"openai_version": openai.__version__}

    ids = [m.id for m in client.models.list()]
    seen["models"] = ids
    check(model in ids, f"/v1/models lists {model}: {ids}")

    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    seen["chat"] = r.choices[0].message.content
    check(r.choices[0].message.content.startswith("hi from"), f"chat content: {r}")

    parts = []
    with client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=5
    ) as stream:
        for chunk in stream:
            for c in chunk.choices:
                if c.delta and c.delta.content:
                    parts.append(c.delta.content)
    seen["stream"] = parts
    check(parts == [f"tok{i}" for i in range(5)], f"streamed deltas: {parts}")

    try:
        client.chat.completions.create(model="no-such-model", messages=[])
        check(False, "unknown model accepted")
    except openai.NotFoundError as e:
        seen["not_found"] = {"status": e.status_code, "code": e.code}
        check(e.status_code == 404 and e.code == "model_not_found", f"404 shape: {e.body}")

    bad = openai.OpenAI(base_url=base.rstrip("/") + "/v1", api_key="wrong", max_retries=0, timeout=30)
    try:
        bad.models.list()
        check(False, "wrong key accepted")
    except openai.AuthenticationError as e:
        seen["bad_key"] = {"status": e.status_code, "code": e.code}
        check(e.status_code == 401 and e.code == "invalid_api_key", f"401 shape: {e.body}")

    print(json.dumps(seen))
    return 0


def check(ok: bool, what: str) -> None:
    if not ok:
        print(f"openai client check failed: {what}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
