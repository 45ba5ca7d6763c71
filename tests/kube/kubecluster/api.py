"""A minimal HTTPS client for the test apiserver (stdlib only) and kubeconfig writing.

Used by the launcher for health checks and bootstrap objects, where spawning kubectl or
importing the kubernetes package would be slow or unwanted.

Invariants:
  * TLS is always verified against the cluster CA; the admin identity is the client cert;
  * ``get``/``post`` return parsed JSON or raise ``ApiError`` carrying the HTTP status;
    ``healthy`` never raises (it is for polling);
  * kubeconfigs are written as JSON (valid YAML), mode 0600, with absolute paths.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class AdminApi:
    def __init__(self, server: str, ca_cert: Path, client_cert: Path, client_key: Path) -> None:
        self.server = server
        self._ctx = ssl.create_default_context(cafile=str(ca_cert))
        self._ctx.load_cert_chain(str(client_cert), str(client_key))

    def _call(self, method: str, path: str, body: object | None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=10) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")[:500]) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ApiError(0, f"{method} {path}: {exc}") from exc

    def get(self, path: str) -> Any:
        return self._call("GET", path, None)

    def post(self, path: str, body: object) -> Any:
        return self._call("POST", path, body)

    def healthy(self, path: str = "/readyz") -> bool:
        try:
            req = urllib.request.Request(self.server + path)
            with urllib.request.urlopen(req, context=self._ctx, timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def plain_https_ok(url: str) -> bool:
    """GET ``url`` without verifying the self-signed serving cert (component /healthz)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=5) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def plain_http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def write_kubeconfig(path: Path, server: str, ca_cert: Path, user: dict[str, str]) -> Path:
    """Write a one-context kubeconfig; ``user`` is e.g. {"token": ...} or cert/key paths."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "mmis-test",
                "cluster": {"server": server, "certificate-authority": str(ca_cert)},
            }
        ],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "mmis-test", "context": {"cluster": "mmis-test", "user": "user"}}],
        "current-context": "mmis-test",
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.chmod(tmp, 0o600)
    tmp.replace(path)
    return path
