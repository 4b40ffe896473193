#!/usr/bin/env python3
"""Minimal Hugging Face Hub-compatible file server for the transfer benchmark.

Serves every file under DIR as the `main` revision of REPO: the tree API (what flexinfer-worker
uses), the revision API and HEAD/GET `resolve` with the headers huggingface_hub expects
(X-Repo-Commit, ETag/X-Linked-Etag, X-Linked-Size), HTTP/1.1 keep-alive, Range requests, and
bodies sent with sendfile(2) so the server is not the bottleneck.

usage: hub_server.py DIR REPO PORT
"""
import hashlib
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

ROOT, REPO, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def describe():
    files = {}
    for d, _, names in os.walk(ROOT):
        for n in names:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, ROOT)
            size = os.path.getsize(p)
            h = hashlib.sha256()
            g = hashlib.sha1()
            g.update(b"blob %d\0" % size)
            with open(p, "rb") as f:
                while True:
                    b = f.read(1 << 22)
                    if not b:
                        break
                    h.update(b)
                    g.update(b)
            files[rel] = {"path": p, "size": size, "sha256": h.hexdigest(), "oid": g.hexdigest(),
                          "lfs": size >= (1 << 20)}
    return files


FILES = describe()


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send_json(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_HEAD(self):
        self.serve(head=True)

    def do_GET(self):
        self.serve(head=False)

    def serve(self, head):
        path = unquote(urlparse(self.path).path)
        for prefix in (f"/api/models/{REPO}/tree/", ):
            if path.startswith(prefix):
                out = []
                for rel, f in sorted(FILES.items()):
                    e = {"type": "file", "path": rel, "size": f["size"], "oid": f["oid"]}
                    if f["lfs"]:
                        e["lfs"] = {"oid": f["sha256"], "size": f["size"], "pointerSize": 134}
                    out.append(e)
                return self.send_json(out)
        if path.startswith(f"/api/models/{REPO}/revision/") or path == f"/api/models/{REPO}":
            return self.send_json({"id": REPO, "modelId": REPO, "sha": COMMIT, "private": False,
                                   "siblings": [{"rfilename": r} for r in sorted(FILES)]})
        prefix = f"/{REPO}/resolve/"
        if not path.startswith(prefix):
            self.send_error(404)
            return
        rest = path[len(prefix):]
        _, _, rel = rest.partition("/")
        f = FILES.get(rel)
        if f is None:
            self.send_error(404)
            return
        size = f["size"]
        start, end = 0, size - 1
        rng = self.headers.get("Range")
        status = 200
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else 0
            end = min(int(b), size - 1) if b else size - 1
            status = 206
        n = max(0, end - start + 1)
        self.send_response(status)
        etag = f['sha256'] if f["lfs"] else f["oid"]
        self.send_header("ETag", f'"{etag}"')
        if f["lfs"]:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(size))
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(n))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head or n == 0:
            return
        with open(f["path"], "rb") as fh:
            off = start
            left = n
            while left > 0:
                sent = os.sendfile(self.connection.fileno(), fh.fileno(), off, min(left, 1 << 24))
                if sent == 0:
                    break
                off += sent
                left -= sent


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # parallel range readers open many connections at once

    def handle_error(self, request, client_address):
        pass  # clients closing connections early (parallel range readers) are not errors here


srv = Server(("127.0.0.1", PORT), H)
print("ready", flush=True)
srv.serve_forever()
