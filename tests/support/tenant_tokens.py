"""A token file with two tenants and an admin (--auth tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from loraplex.inference_server.auth.tokens import hash_token


TOKENS = {"a": "token-tenant-a-0123456789", "b": "token-tenant-b-0123456789", "admin": "token-admin-0123456789xx"}


def write_tokens(path: Path, tokens: dict[str, str]) -> None:
    entries = [{"sha256": hash_token(tok), "tenant": "ops" if who == "admin" else who,
                "role": "admin" if who == "admin" else "tenant"} for who, tok in tokens.items()]
    path.write_text(json.dumps({"tokens": entries}))
