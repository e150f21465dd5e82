"""A JSON POST to an HTTP edge, its status and body (errors included)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def _post(root: str, path: str, body: dict, token: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(root + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
