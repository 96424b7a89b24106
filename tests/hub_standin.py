"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1, enough for HfApi.create_repo, upload_file,
upload_folder (files sent inline: the preupload answer is "regular" for every file, so no LFS / Xet transfer is
exercised) and snapshot_download of what was committed. It records every request and commit."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class HubStandIn:
    def __init__(self, fail_commits: bool = False):
        self.fail_commits = fail_commits
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict] = []
        self.commits: list[dict] = []  # {"repo": ..., "message": ..., "files": {path: bytes}}
        self.files: dict[tuple[str, str], bytes] = {}  # (repo_id, path) -> content
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body=b"", ctype="application/json", headers=None):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def do_POST(self):
                path = unquote(urlparse(self.path).path)
                stand_in.requests.append(("POST", path))
                body = self._body()
                if path == "/api/repos/create":
                    req = json.loads(body)
                    stand_in.created.append(req)
                    repo = f"{req.get('organization')}/{req['name']}"
                    return self._send(200, {"url": f"{stand_in.url}/{repo}", "name": repo})
                parts = path.split("/")
                if len(parts) >= 7 and parts[1] == "api" and parts[5] == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files]})
                if len(parts) >= 7 and parts[1] == "api" and parts[5] == "commit":
                    if stand_in.fail_commits:
                        return self._send(500, {"error": "stand-in refuses commits"})
                    repo = "/".join(parts[3:5])
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    commit = {"repo": repo, "message": None, "files": {}}
                    for line in lines:
                        if line["key"] == "header":
                            commit["message"] = line["value"]["summary"]
                        elif line["key"] == "file":
                            content = base64.b64decode(line["value"]["content"])
                            commit["files"][line["value"]["path"]] = content
                            stand_in.files[(repo, line["value"]["path"])] = content
                    stand_in.commits.append(commit)
                    oid = stand_in.head()
                    return self._send(200, {"commitUrl": f"http://127.0.0.1/{repo}/commit/{oid}", "commitOid": oid,
                                            "pullRequestUrl": None})
                return self._send(404, {"error": f"stand-in: no POST {path}"})

            def do_GET(self):
                path = unquote(urlparse(self.path).path)
                stand_in.requests.append((self.command, path))
                parts = path.split("/")
                if parts[1] == "api" and len(parts) >= 7 and parts[5] == "revision":  # repo_info / snapshot
                    repo = "/".join(parts[3:5])
                    siblings = [{"rfilename": p} for (r, p) in stand_in.files if r == repo]
                    return self._send(200, {"id": repo, "sha": stand_in.head(), "siblings": siblings, "private": True})
                if parts[1] == "api" and len(parts) >= 7 and parts[5] == "tree":  # list_repo_tree (snapshot)
                    repo = "/".join(parts[3:5])
                    return self._send(200, [{"type": "file", "path": p, "size": len(c),
                                             "oid": hashlib.sha1(c).hexdigest()}
                                            for (r, p), c in stand_in.files.items() if r == repo])
                if "resolve" in parts:  # /<owner>/<repo>/resolve/<rev>/<path>
                    i = parts.index("resolve")
                    repo, file_path = "/".join(parts[1:i]), "/".join(parts[i + 2:])
                    content = stand_in.files.get((repo, file_path))
                    if content is None:
                        return self._send(404, {"error": "not found"}, headers={"X-Error-Code": "EntryNotFound"})
                    etag = hashlib.sha1(content).hexdigest()
                    return self._send(200, content, "application/octet-stream",
                                      {"ETag": f'"{etag}"', "X-Repo-Commit": stand_in.head()})
                return self._send(404, {"error": f"stand-in: no GET {path}"})

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def head(self) -> str:
        """The repository's commit id: changes with every commit (huggingface_hub caches tree listings by it)."""
        return hashlib.sha1(str(len(self.commits)).encode()).hexdigest()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
