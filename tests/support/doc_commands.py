"""Whether a command a doc shows is one the code accepts."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any
from doc_sources import Command
from loraplex.adapter_store.main import parse_args as store_args
from loraplex.clients.cli import build_parser as cli_parser
from loraplex.inference_server.settings import ServerSettings


def command_failure(command: Command) -> str | None:
    """Why ``command`` would not start as written (None: its program's parser accepts it)."""
    args = list(command.args)
    if command.program == "loraplex-server" or (command.program == "loraplex" and args[:1] == ["serve"]):
        server_args = args[1:] if command.program == "loraplex" else args
        return _parse_failure(lambda: ServerSettings.from_sources(server_args, env={}))
    if command.program == "loraplex-store":
        return _parse_failure(lambda: store_args(args, env={}))
    if command.program == "loraplex":
        return _parse_failure(lambda: cli_parser().parse_args(args))
    return None


def _parse_failure(parse: Callable[[], Any]) -> str | None:
    """None if ``parse()`` accepts the command, else what the parser said."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse()
    except SystemExit as exc:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    except ValueError as exc:
        return str(exc)
    return None
