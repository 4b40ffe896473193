#!/usr/bin/env python3
"""A local Hugging Face Hub-compatible file server (demo, end-to-end test, transfer benchmark).

Serves repositories from a directory tree, read-only, as the hub's HTTP API does:
  ROOT/models/<org>/<name>/...     model repos     (/api/models/<repo>/..., /<repo>/resolve/<rev>/<file>)
  ROOT/datasets/<org>/<name>/...   dataset repos   (/api/datasets/<repo>/..., /datasets/<repo>/resolve/<rev>/<file>)
Endpoints: the tree API (what flexinfer-worker lists), the revision/info API, and HEAD/GET `resolve` with the
headers huggingface_hub expects (X-Repo-Commit, ETag/X-Linked-Etag, X-Linked-Size), Range requests,
HTTP/1.1 keep-alive, bodies sent with sendfile(2). Each repo's commit id is derived from its content, so a
changed repo is a new revision. Any revision name (`main`, or the commit id) resolves to the current files.

usage: hub_server.py --root ROOT [--host 127.0.0.1] [--port 0] [--ready-file FILE]
       hub_server.py DIR REPO PORT          (one model repo from DIR; the transfer benchmark's form)
Prints "ready <port>" once listening (and writes the port to --ready-file).
"""
import argparse
import hashlib
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def describe(root):
    files = {}
    for d, dirs, names in os.walk(root):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
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
    commit = hashlib.sha1("".join(f"{r}\0{f['oid']}\n" for r, f in sorted(files.items())).encode()).hexdigest()
    return {"files": files, "commit": commit}


def load_repos(root):
    repos = {"models": {}, "datasets": {}}
    for kind in repos:
        base = os.path.join(root, kind)
        if not os.path.isdir(base):
            continue
        for org in sorted(os.listdir(base)):
            for name in sorted(os.listdir(os.path.join(base, org))):
                d = os.path.join(base, org, name)
                if os.path.isdir(d):
                    repos[kind][f"{org}/{name}"] = describe(d)
    return repos


def make_handler(repos):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def send_json(self, obj, status=200):
            b = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

        def not_found(self, what):
            self.send_response(404)
            b = json.dumps({"error": f"{what} not found"}).encode()
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Error-Code", "RepoNotFound" if "repo" in what else "EntryNotFound")
            self.send_header("Content-Length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

        def do_HEAD(self):
            self.serve(head=True)

        def do_GET(self):
            self.serve(head=False)

        def find_repo(self, kind, rest):
            """Longest `org/name` prefix of `rest` that is a repo of `kind` -> (repo, remainder)."""
            parts = rest.split("/")
            if len(parts) >= 2 and f"{parts[0]}/{parts[1]}" in repos[kind]:
                return f"{parts[0]}/{parts[1]}", "/".join(parts[2:])
            return None, None

        def serve(self, head):
            path = unquote(urlparse(self.path).path)
            if path.startswith("/api/"):
                kind, _, rest = path[len("/api/"):].partition("/")
                if kind not in repos:
                    return self.not_found("api route")
                repo, tail = self.find_repo(kind, rest)
                if repo is None:
                    return self.not_found(f"repo {rest}")
                r = repos[kind][repo]
                if tail.startswith("tree/"):
                    # tree/<rev>[/<subdir>]
                    _, _, sub = tail[len("tree/"):].partition("/")
                    out = []
                    for rel, f in sorted(r["files"].items()):
                        if sub and not rel.startswith(sub.rstrip("/") + "/"):
                            continue
                        e = {"type": "file", "path": rel, "size": f["size"], "oid": f["oid"]}
                        if f["lfs"]:
                            e["lfs"] = {"oid": f["sha256"], "size": f["size"], "pointerSize": 134}
                        out.append(e)
                    return self.send_json(out)
                if tail == "" or tail.startswith("revision/"):
                    return self.send_json({"id": repo, "modelId": repo, "sha": r["commit"], "private": False,
                                           "siblings": [{"rfilename": n} for n in sorted(r["files"])]})
                return self.not_found("api route")
            kind = "models"
            rest = path.lstrip("/")
            if rest.startswith("datasets/"):
                kind, rest = "datasets", rest[len("datasets/"):]
            repo, tail = self.find_repo(kind, rest)
            if repo is None or not tail.startswith("resolve/"):
                return self.not_found(f"repo {rest}")
            _, _, rel = tail[len("resolve/"):].partition("/")
            r = repos[kind][repo]
            f = r["files"].get(rel)
            if f is None:
                return self.not_found(f"file {rel}")
            size = f["size"]
            start, end = 0, size - 1
            rng = self.headers.get("Range")
            status = 200
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                try:
                    start = int(a) if a else 0
                    end = min(int(b), size - 1) if b else size - 1
                except ValueError:
                    self.send_error(416)
                    return
                status = 206
            n = max(0, end - start + 1)
            self.send_response(status)
            etag = f["sha256"] if f["lfs"] else f["oid"]
            self.send_header("ETag", f'"{etag}"')
            if f["lfs"]:
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(size))
            self.send_header("X-Repo-Commit", r["commit"])
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

    return H


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # parallel range readers open many connections at once

    def handle_error(self, request, client_address):
        pass  # clients closing connections early (parallel range readers) are not errors here


def main():
    if len(sys.argv) == 4 and not sys.argv[1].startswith("-"):
        src, repo, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
        repos = {"models": {repo: describe(src)}, "datasets": {}}
        host, ready = "127.0.0.1", None
    else:
        ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        ap.add_argument("--root", required=True)
        ap.add_argument("--host", default="127.0.0.1")
        ap.add_argument("--port", type=int, default=0)
        ap.add_argument("--ready-file")
        a = ap.parse_args()
        repos, host, port, ready = load_repos(a.root), a.host, a.port, a.ready_file
    srv = Server((host, port), make_handler(repos))
    port = srv.server_address[1]
    if ready:
        with open(ready + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(ready + ".tmp", ready)
    print(f"ready {port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
