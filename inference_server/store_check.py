"""At start, before the model loads: the adapter store sidecar (``--adapter-store``) must answer
and accept the server's shared secret.

A store that refuses the secret is a setting to fix, so the server stops at once with a message
naming ``--adapter-store-secret-file``. A store that does not answer yet (starting beside the
server) is waited for up to ``--adapter-store-wait-s``, with health NOT_SERVING and one log
line saying why, not one a second; then the server stops naming ``--adapter-store``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.adapter_store.client import SECRET_FIX, StoreClient
from loraplex.adapter_store.errors import LoraplexError, StoreRefusedError
from loraplex.adapter_store.secret import read_secret

log = logging.getLogger("loraplex.inference_server")


class StoreStartupError(Exception):
    """The server cannot start with the adapter store as configured; the message names the fix."""


@dataclass(frozen=True, slots=True)
class StoreCheck:
    """Where the store is, the file of its shared secret (None: none sent), and how long to wait."""

    address: str
    secret_file: str | None = None
    wait_s: float = 60.0
    retry_s: float = 1.0

    def secret(self) -> str | None:
        """The shared secret to send; StoreStartupError naming the flag if its file is unusable."""
        if self.secret_file is None:
            return None
        try:
            return read_secret(self.secret_file)
        except ValueError as e:
            raise StoreStartupError(f"--adapter-store-secret-file: {e}") from None


def wait_for_store(check: StoreCheck, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once the store answers and accepts the secret; StoreStartupError otherwise."""
    secret = check.secret()
    deadline = clock() + check.wait_s
    waiting = False
    with StoreClient(check.address, secret=secret) as client:
        while True:
            try:
                client.check_access(timeout_s=min(5.0, max(0.5, check.wait_s)))
            except StoreRefusedError:
                raise StoreStartupError(_refused(check)) from None
            except LoraplexError as e:
                if clock() >= deadline:
                    raise StoreStartupError(
                        f"the adapter store at {check.address} did not answer within {check.wait_s:g}s ({e}): start "
                        "loraplex-store there, or fix --adapter-store (LORAPLEX_ADAPTER_STORE); "
                        "--adapter-store-wait-s sets how long to wait") from None
                if not waiting:
                    log.warning("waiting up to %gs for the adapter store at %s (%s); health stays NOT_SERVING",
                                check.wait_s, check.address, e)
                    waiting = True
                sleep(check.retry_s)
                continue
            log.info("the adapter store at %s answers%s", check.address,
                     " and accepts the shared secret" if secret is not None else "")
            return


def _refused(check: StoreCheck) -> str:
    if check.secret_file is None:
        return (f"the adapter store at {check.address} refuses the server's calls (UNAUTHENTICATED): it was started "
                "with --secret-file and the server sends no secret: pass the same file with "
                "--adapter-store-secret-file (LORAPLEX_ADAPTER_STORE_SECRET_FILE)")
    return (f"the adapter store at {check.address} refuses the secret in {check.secret_file} (UNAUTHENTICATED): "
            f"{SECRET_FIX}")
