"""Bearer tokens -> (tenant, role), from a JSON file of sha256 hashes, reloaded when it changes.

File format (a Kubernetes Secret mounts the same file)::

    {"tokens": [{"sha256": "<hex of sha256(token)>", "tenant": "acme", "role": "tenant"},
                {"sha256": "...", "tenant": "ops", "role": "admin"}]}

Only hashes are kept; a presented token is hashed and compared to every entry with
``hmac.compare_digest`` (constant time). Tokens never appear in messages or logs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable

from loraplex.adapter_store.tenants.principal import Principal, Role
from loraplex.clients.token_format import TOKEN_RULE, is_token

log = logging.getLogger(__name__)
MAX_TOKEN_LEN = 512
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")


class AuthError(Exception):
    """Authentication failed; the message says why without repeating the token."""


def hash_token(token: str) -> str:
    """The hex sha256 of a token, as written in the tokens file."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def parse_bearer(value: str | None) -> str:
    """The token of an ``authorization: Bearer <token>`` value; AuthError on any other shape."""
    if value is None or value == "":
        raise AuthError("missing credentials: send 'authorization: Bearer <token>'")
    if len(value) > MAX_TOKEN_LEN + 16:
        raise AuthError("malformed credentials: authorization value too long")
    scheme, sep, token = value.partition(" ")
    if scheme.lower() != "bearer" or not sep:
        raise AuthError("malformed credentials: expected 'Bearer <token>'")
    if not is_token(token):
        raise AuthError(f"malformed credentials: {TOKEN_RULE}")
    return token


def parse_tokens_file(text: str, source: str = "tokens file") -> list[tuple[bytes, Principal]]:
    """[(sha256 digest, principal)] from the file's JSON; ValueError naming the bad entry."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    entries = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f'{source}: expected an object {{"tokens": [...]}}')
    out: list[tuple[bytes, Principal]] = []
    first: dict[str, int] = {}  # digest -> the entry that listed it
    for i, entry in enumerate(entries):
        where = f"{source}: tokens[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object with sha256, tenant and role")
        digest = str(entry.get("sha256", "")).lower()
        if not _HEX64.match(digest):
            raise ValueError(f"{where}: sha256 must be 64 hex characters (hash the token; never store it)")
        if digest in first:  # one token, two identities: which one it would act as is not to be guessed
            raise ValueError(f"{where}: the same sha256 as tokens[{first[digest]}]; each token is listed once")
        first[digest] = i
        try:
            role = Role(entry.get("role", "tenant"))
        except ValueError:
            raise ValueError(f"{where}: role must be 'tenant' or 'admin', got {entry.get('role')!r}") from None
        try:
            principal = Principal(str(entry.get("tenant", "")), role)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        out.append((bytes.fromhex(digest), principal))
    return out


class TokenTable:
    """An immutable set of token hashes; ``lookup`` is constant-time per entry."""

    def __init__(self, entries: list[tuple[bytes, Principal]]) -> None:
        self._entries = tuple(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode("ascii")).digest()
        found = None
        for stored, principal in self._entries:  # no early exit: timing does not depend on the match
            if hmac.compare_digest(stored, digest):
                found = principal
        return found


class TokenFile:
    """The tokens file, re-read when its modification time, size or inode changes.

    The file is checked at most every ``check_interval_s`` seconds, on use. A file that
    becomes invalid is logged and the previous table stays in force.
    """

    def __init__(self, path: str, check_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if check_interval_s < 0:
            raise ValueError(f"check_interval_s must be >= 0, got {check_interval_s}")
        self.path = path
        self._interval = check_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._signature: tuple[int, int, int] | None = None
        self._table = TokenTable(self._read())  # a bad file at start-up is an error (ValueError/OSError)
        self._checked = clock()
        self.reloads = 0

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _read(self) -> list[tuple[bytes, Principal]]:
        signature = self._stat()
        with open(self.path, encoding="utf-8") as f:
            entries = parse_tokens_file(f.read(), self.path)
        self._signature = signature
        return entries

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked < self._interval:
            return
        self._checked = now
        try:
            if self._stat() == self._signature:
                return
            self._table = TokenTable(self._read())
            self.reloads += 1
            log.info("tokens file %s reloaded (%d tokens)", self.path, len(self._table))
        except (OSError, ValueError) as exc:
            log.error("tokens file %s not reloaded, keeping the previous tokens: %s", self.path, exc)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an ``authorization`` metadata value; AuthError if it names none."""
        token = parse_bearer(authorization)
        with self._lock:
            self._maybe_reload()
            table = self._table
        principal = table.lookup(token)
        if principal is None:
            raise AuthError("invalid token")
        return principal
