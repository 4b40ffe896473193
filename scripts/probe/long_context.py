#!/usr/bin/env python3
"""Long-context readiness probe of an OpenAI-compatible endpoint (the promotion gate's input).

Runs three chat completions against ENDPOINT (the FlexInfer proxy, a LiteLLM in front of it, or a backend):
  short   "What is 2 + 2?"                                     -> the answer must contain 4
  medium  ~MEDIUM_TOKENS of filler with a verification code  -> the answer must contain the code
  long    ~LONG_TOKENS of the same                           -> the answer must contain the code
and judges each answer: empty, mostly unprintable, or one word / phrase repeated over and over is garbage; a
missing "4" or code is a wrong answer. Writes OUT_DIR/probe.json and OUT_DIR/probe.md (prompt and completion
tokens as the server counted them, elapsed time, the answer, the verdict) and exits 1 when any probe fails
(2 on bad settings or when the endpoint cannot be reached at all).

Environment:
  ENDPOINT       base URL, with or without /v1 (required), e.g. http://flexinfer-proxy.flexinfer-system.svc:8000
  MODEL          model name or alias (required)
  AUTH_TOKEN     sent as "Authorization: Bearer ..." (optional)
  POD_SELECTOR   label selector of the serving pods: their log lines about KV cache, memory and errors are
                 added to the report (kubectl logs; optional), NAMESPACE their namespace
  LONG_TOKENS    30000, MEDIUM_TOKENS 4000 (approximate prompt sizes), MAX_TOKENS 64, TIMEOUT 900 (s per request)
  OUT_DIR        where the report goes (default ./probe-<model>-<UTC time>)
"""
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

FILLER = ("The archive keeps its records in numbered boxes. Each box holds letters, receipts and notes about "
          "the weather, the harvest and the prices at the market. ")
# Roughly what an English BPE tokenizer makes of FILLER: used only to size the prompt.
FILLER_TOKENS = 36


def env_int(name, default):
    v = os.environ.get(name, "")
    try:
        return int(v) if v else default
    except ValueError:
        sys.exit(f"probe: {name}={v!r} is not a number")


def chat(base, model, token, prompt, max_tokens, timeout):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.load(r)
    except urllib.error.HTTPError as e:
        return {"error": f"HTTP {e.code}: {e.read()[:500].decode(errors='replace')}", "elapsed_s": time.monotonic() - t0}
    except (urllib.error.URLError, OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}", "elapsed_s": time.monotonic() - t0, "unreachable": True}
    msg = ((out.get("choices") or [{}])[0].get("message") or {})
    usage = out.get("usage") or {}
    return {"answer": msg.get("content") or "", "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"), "elapsed_s": round(time.monotonic() - t0, 3),
            "finish_reason": (out.get("choices") or [{}])[0].get("finish_reason")}


def garbage(text):
    """Why `text` is garbage, or None."""
    t = text.strip()
    if not t:
        return "empty answer"
    bad = sum(1 for ch in t if ch == "\ufffd" or (not ch.isprintable() and ch not in "\n\t"))
    if bad / len(t) > 0.1:
        return f"{bad} of {len(t)} characters unprintable"
    words = re.findall(r"\w+", t.lower())
    if len(words) >= 8:
        top = max(words.count(w) for w in set(words))
        if top / len(words) > 0.5:
            return f"one word is {top} of {len(words)} words"
        grams = [" ".join(words[i:i + 3]) for i in range(len(words) - 2)]
        gtop = max(grams.count(g) for g in set(grams))
        if gtop >= 4 and gtop * 3 / len(words) > 0.5:
            return f"one three-word phrase repeats {gtop} times"
    return None


def retention_prompt(code, tokens):
    n = max(1, tokens // FILLER_TOKENS)
    half = n // 2
    return (f"Remember this verification code: {code}.\n\n" + FILLER * half +
            f"\n(The verification code is {code}.)\n\n" + FILLER * (n - half) +
            "\n\nQuestion: what is the verification code given above? Answer with the code only.")


def pod_hints(selector, namespace):
    cmd = ["kubectl", "logs", "-l", selector, "--tail=400", "--all-containers", "--prefix"]
    if namespace:
        cmd += ["-n", namespace]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"kubectl logs: {e}"]
    if out.returncode != 0:
        return [f"kubectl logs: {out.stderr.strip()[:300]}"]
    pat = re.compile(r"KV|kv cache|out of memory|OOM|error|Model loading took|max_model_len|n_ctx", re.I)
    return [l for l in out.stdout.splitlines() if pat.search(l)][-40:]


def main():
    endpoint, model = os.environ.get("ENDPOINT", "").rstrip("/"), os.environ.get("MODEL", "")
    if not endpoint or not model:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    base = endpoint if endpoint.endswith("/v1") else endpoint + "/v1"
    token = os.environ.get("AUTH_TOKEN", "")
    long_t, med_t = env_int("LONG_TOKENS", 30000), env_int("MEDIUM_TOKENS", 4000)
    max_tokens, timeout = env_int("MAX_TOKENS", 64), env_int("TIMEOUT", 900)
    out_dir = os.environ.get("OUT_DIR") or f"probe-{re.sub(r'[^A-Za-z0-9._-]', '_', model)}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    os.makedirs(out_dir, exist_ok=True)
    code = f"{random.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{random.randint(1000, 9999)}-{random.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{random.randint(10, 99)}"
    probes = [("short", "What is 2 + 2? Answer with the number only.", "4"),
              ("medium", retention_prompt(code, med_t), code),
              ("long", retention_prompt(code, long_t), code)]
    results, failed = [], 0
    for name, prompt, want in probes:
        r = chat(base, model, token, prompt, max_tokens, timeout)
        if r.get("unreachable") and name == "short":
            print(f"probe: {base} cannot be reached: {r['error']}", file=sys.stderr)
            sys.exit(2)
        if "error" in r:
            verdict = f"error: {r['error']}"
        else:
            why = garbage(r["answer"])
            verdict = (f"garbage: {why}" if why else
                       "pass" if want.lower() in r["answer"].lower() else f"wrong answer: expected {want!r}")
        r.update({"probe": name, "approx_prompt_tokens": len(prompt) // 4, "expected": want, "verdict": verdict})
        failed += verdict != "pass"
        results.append(r)
        print(f"{name:6} {verdict} (prompt tokens {r.get('prompt_tokens')}, {r.get('elapsed_s')} s)")
    hints = pod_hints(os.environ["POD_SELECTOR"], os.environ.get("NAMESPACE", "")) if os.environ.get("POD_SELECTOR") else []
    report = {"endpoint": base, "model": model, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "passed": failed == 0, "probes": results, "pod_log_hints": hints}
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out_dir, "probe.md"), "w") as f:
        f.write(f"# Long-context probe: {model}\n\n{report['time']}, {base}: **{'passed' if failed == 0 else 'FAILED'}**\n\n")
        f.write("| probe | prompt tokens | completion tokens | elapsed, s | verdict |\n|---|---|---|---|---|\n")
        for r in results:
            f.write(f"| {r['probe']} | {r.get('prompt_tokens')} | {r.get('completion_tokens')} | {r.get('elapsed_s')} | {r['verdict']} |\n")
        for r in results:
            f.write(f"\n## {r['probe']}\n\n```\n{(r.get('answer') or r.get('error') or '')[:2000]}\n```\n")
        if hints:
            f.write("\n## Serving pod log lines\n\n```\n" + "\n".join(hints) + "\n```\n")
    print(f"report: {out_dir}/probe.json, {out_dir}/probe.md")
    sys.exit(1 if failed else 0)


main()
