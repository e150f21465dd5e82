"""What a bearer token may be: the one rule the clients check before sending a token (and
``loraplex hash-token`` before hashing one) and the server checks when it reads one
(inference_server/auth/tokens.py), so a token the server would refuse is named on the client."""

from __future__ import annotations

import re

TOKEN_RULE = "a token is 16-512 printable ASCII characters without spaces"
_TOKEN = re.compile(r"^[\x21-\x7e]{16,512}\Z")


def is_token(text: str) -> bool:
    """Whether ``text`` is a well-formed token (``TOKEN_RULE``)."""
    return bool(_TOKEN.match(text))
