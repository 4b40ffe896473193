#!/usr/bin/env python3
"""Tests of long_context.py against small OpenAI-compatible servers: one that answers right, one that repeats a
word, one that forgets the code in the long prompt, one that is not there. Exits non-zero on the first failure."""
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))


def server(answer):
    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/chat/completions", self.path
            H.auth.append(self.headers.get("Authorization"))
            prompt = body["messages"][0]["content"]
            text = answer(prompt)
            out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                              "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": 5}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass
    H.auth = []
    s = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return s, H


def code_of(prompt):
    m = re.search(r"verification code: (\S+)\.", prompt)
    return m.group(1) if m else "?"


def right(prompt):
    return "4" if "2 + 2" in prompt else f"The code is {code_of(prompt)}."


def run(port, out, **extra):
    env = dict(os.environ, ENDPOINT=f"http://127.0.0.1:{port}", MODEL="m", OUT_DIR=out,
               LONG_TOKENS="3000", MEDIUM_TOKENS="500", AUTH_TOKEN="k1", **extra)
    env.pop("POD_SELECTOR", None)
    return subprocess.run([sys.executable, os.path.join(HERE, "long_context.py")], env=env, capture_output=True, text=True)


def main():
    cases = [
        ("a right server passes", right, 0, ["pass", "pass", "pass"]),
        ("a repeating server is garbage", lambda p: "the " * 40, 1, ["garbage"] * 3),
        ("a server that forgets the code in the long prompt fails it",
         lambda p: right(p) if len(p) < 8000 else "I do not know.", 1, ["pass", "pass", "wrong answer"]),
        ("unprintable output is garbage", lambda p: "\ufffd" * 30, 1, ["garbage"] * 3),
    ]
    for name, answer, rc, verdicts in cases:
        s, h = server(answer)
        with tempfile.TemporaryDirectory() as d:
            r = run(s.server_address[1], d)
            assert r.returncode == rc, f"{name}: exit {r.returncode}, want {rc}\n{r.stdout}\n{r.stderr}"
            rep = json.load(open(os.path.join(d, "probe.json")))
            got = [p["verdict"] for p in rep["probes"]]
            assert all(g.startswith(v) for g, v in zip(got, verdicts)), f"{name}: verdicts {got}, want {verdicts}"
            assert rep["passed"] == (rc == 0), name
            md = open(os.path.join(d, "probe.md")).read()
            assert "| long |" in md and ("passed" if rc == 0 else "FAILED") in md, md
            assert h.auth == ["Bearer k1"] * 3, h.auth
        s.shutdown()
        print(f"ok   {name}")
    with tempfile.TemporaryDirectory() as d:
        r = run(1, d)
        assert r.returncode == 2 and "cannot be reached" in r.stderr, (r.returncode, r.stderr)
    print("ok   an unreachable endpoint exits 2")


main()
