"""``loraplex``: the command-line client (and ``loraplex serve`` to start a server).

    loraplex serve [server flags]                 start a server (same flags as loraplex-server)
    loraplex generate "Why is the sky blue?"      stream an answer (chat template; --raw for plain text)
    loraplex generate --adapter pirate "Hi"       ... through an adapter
    loraplex generate --json-object -n 2 "A cat as JSON"   sampling, stopping and format flags: --help
    loraplex adapters upload pirate ./pirate      upload a PEFT LoRA folder (progress bar)
    loraplex adapters upload --public acme/pirate ./pirate   ... that every tenant may use
    loraplex adapters list | show ID | delete ID
    loraplex health [--wait 60]                   exit 0 when SERVING
    loraplex info                                 the served model and limits
    loraplex hash-token < token.txt               the sha256 to put in a server's tokens file

The server address comes from --address or LORAPLEX_ADDRESS (default 127.0.0.1:50051); the
token from --token or LORAPLEX_TOKEN; TLS from --tls / --tls-root-cert (LORAPLEX_TLS_ROOT_CERT).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from loraplex.clients.cli_generate import EXIT_OK, add_generate_arguments, generate

EXIT_ERROR, EXIT_USAGE = 1, 2
DEFAULT_CALL_TIMEOUT = 30.0  # seconds, a call other than generate's stream and uploads
DEFAULT_UPLOAD_TIMEOUT = 600.0  # seconds, an upload when --timeout is not given


def _seconds(text: str) -> float:
    """A --timeout: a finite number of seconds > 0 (0, negatives and nan only ever timed out)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _wait_seconds(text: str) -> float:
    """A health --wait: a finite number of seconds >= 0 (0 = ask once; a negative or nan was taken as 0)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (0 = ask once), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every subcommand except ``serve`` (which takes the server's flags)."""
    from loraplex.clients.requests import DEFAULT_ADDRESS  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="loraplex", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--address", default=os.environ.get("LORAPLEX_ADDRESS") or DEFAULT_ADDRESS,
                   help="server host:port (env LORAPLEX_ADDRESS)")
    p.add_argument("--timeout", type=_seconds, default=None,
                   help=f"seconds per call (default {DEFAULT_CALL_TIMEOUT:g}); generate: the whole stream, no limit "
                        "unless given (a long answer on a CPU takes minutes); adapters upload: the whole upload "
                        f"(default {DEFAULT_UPLOAD_TIMEOUT:g})")
    p.add_argument("--token", default=os.environ.get("LORAPLEX_TOKEN") or None,
                   help="bearer token for a server started with --auth tokens (env LORAPLEX_TOKEN)")
    p.add_argument("--tls", action="store_true", help="connect with TLS using the system's CAs")
    p.add_argument("--tls-root-cert", default=os.environ.get("LORAPLEX_TLS_ROOT_CERT") or None, metavar="PEM",
                   help="CA certificate the server's certificate chains to; implies --tls (env LORAPLEX_TLS_ROOT_CERT)")
    p.add_argument("--tls-client-cert", default=os.environ.get("LORAPLEX_TLS_CLIENT_CERT") or None, metavar="PEM",
                   help="client certificate for mutual TLS (env LORAPLEX_TLS_CLIENT_CERT)")
    p.add_argument("--tls-client-key", default=os.environ.get("LORAPLEX_TLS_CLIENT_KEY") or None, metavar="PEM",
                   help="key of --tls-client-cert (env LORAPLEX_TLS_CLIENT_KEY)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="start a server (see `loraplex serve --help`)", add_help=False)
    add_generate_arguments(sub.add_parser("generate", help="stream a generation"))
    adapters = sub.add_parser("adapters", help="manage adapters").add_subparsers(dest="action", required=True)
    up = adapters.add_parser("upload", help="upload a PEFT LoRA folder")
    up.add_argument("adapter_id", help="name or tenant/name")
    up.add_argument("folder", help="folder with adapter_config.json and adapter_model.safetensors")
    up.add_argument("--public", action="store_true",
                    help="every tenant may generate with it, show it and list it (only you and admins may "
                         "write it); each upload sets this anew: re-uploading without --public makes it private")
    ls = adapters.add_parser("list", help="list adapters")
    ls.add_argument("--prefix", default="", help="only ids starting with this")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    show = adapters.add_parser("show", help="one adapter's details (JSON)")
    show.add_argument("adapter_id")
    rm = adapters.add_parser("delete", help="delete an adapter")
    rm.add_argument("adapter_id")
    health = sub.add_parser("health", help="exit 0 if the server is SERVING")
    health.add_argument("--wait", type=_wait_seconds, default=0.0, metavar="SECONDS",
                        help="poll until SERVING, up to this long")
    sub.add_parser("info", help="the served model and the server's limits (JSON)")
    sub.add_parser("hash-token", help="read a token on stdin, print its entry for a tokens file's sha256")
    return p


def _upload(client: Any, args: argparse.Namespace) -> int:
    from tqdm import tqdm  # noqa: PLC0415

    from loraplex.clients.requests import check_folder  # noqa: PLC0415

    check_folder(args.folder)  # a folder that is not an adapter's: say so before a bar is drawn
    with tqdm(desc=f"uploading {args.adapter_id}", unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr) as bar:
        def progress(sent: int, total: int) -> None:
            bar.total = total
            bar.update(sent - bar.n)

        info = client.upload_adapter(args.adapter_id, args.folder, public=args.public, progress=progress,
                                     timeout=args.timeout or DEFAULT_UPLOAD_TIMEOUT)
    print(f"uploaded {info.adapter_id} (version {info.version}, rank {info.rank}, {info.size_bytes} bytes, "
          f"{info.visibility})")
    return EXIT_OK


def _list(client: Any, args: argparse.Namespace) -> int:
    adapters = client.list_adapters(args.prefix)
    if args.json:
        for a in adapters:
            print(json.dumps(asdict(a)))
        return EXIT_OK
    rows = [("ID", "VISIBILITY", "RANK", "ALPHA", "DTYPE", "BYTES", "VERSION", "TARGETS")]
    rows += [(a.adapter_id, a.visibility, str(a.rank), f"{a.lora_alpha:g}", a.dtype,
              str(a.size_bytes), a.version, ",".join(a.target_modules)) for a in adapters]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return EXIT_OK


def _health(client: Any, args: argparse.Namespace) -> int:
    """The inference service's health (a whole server's, "", was SERVING on the adapter store's port too)."""
    from loraplex.clients.requests import SERVICE  # noqa: PLC0415
    from loraplex.clients.transport import NOT_INFERENCE_SERVICE  # noqa: PLC0415

    if args.wait > 0:
        client.wait_until_serving(timeout=args.wait)
    status = client.health(SERVICE)
    print(status)
    if status == "SERVICE_UNKNOWN":
        print(f"loraplex: {NOT_INFERENCE_SERVICE}", file=sys.stderr)
    return EXIT_OK if status == "SERVING" else EXIT_ERROR


def _dispatch(client: Any, args: argparse.Namespace) -> int:
    if args.command == "generate":
        return generate(client, args)
    if args.command == "health":
        return _health(client, args)
    if args.command == "info":
        print(json.dumps(asdict(client.server_info()), indent=2))
        return EXIT_OK
    if args.action == "upload":
        return _upload(client, args)
    if args.action == "list":
        return _list(client, args)
    if args.action == "show":
        print(json.dumps(asdict(client.get_adapter(args.adapter_id)), indent=2))
        return EXIT_OK
    client.delete_adapter(args.adapter_id)
    print(f"deleted {args.adapter_id}")
    return EXIT_OK


def _tls(args: argparse.Namespace) -> Any:
    from loraplex.clients.security import TlsConfig  # noqa: PLC0415

    if not (args.tls or args.tls_root_cert or args.tls_client_cert or args.tls_client_key):
        return None
    return TlsConfig(args.tls_root_cert, args.tls_client_cert, args.tls_client_key)


def _hash_token() -> int:
    """The sha256 of the token on stdin (one line), to put in a tokens file; the token is not echoed.
    A token the server would refuse (``token_format.TOKEN_RULE``) is refused here, not hashed."""
    import hashlib  # noqa: PLC0415

    from loraplex.clients.token_format import TOKEN_RULE, is_token  # noqa: PLC0415

    token = sys.stdin.readline().rstrip("\r\n")
    if not token:
        print("loraplex: hash-token reads the token from stdin", file=sys.stderr)
        return EXIT_USAGE
    if not is_token(token):
        print(f"loraplex: hash-token: servers refuse this token ({len(token)} characters): {TOKEN_RULE}",
              file=sys.stderr)
        return EXIT_USAGE
    print(hashlib.sha256(token.encode("utf-8")).hexdigest())
    return EXIT_OK


def serve(server_args: list[str]) -> None:
    """``loraplex serve``: this process becomes the server (``python -m loraplex.inference_server.main``,
    the same as ``loraplex-server``). The client package never imports the server or torch;
    the server keeps this process's id, so signals (SIGTERM drains) reach it directly."""
    os.execv(sys.executable, [sys.executable, "-P", "-m", "loraplex.inference_server.main", *server_args])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``loraplex`` console script."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # ctrl-C at any point, the imports and argument parsing included
        return 130


def _main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        serve(argv[1:])
    # gRPC's own log lines (a failed TLS handshake, a key it cannot load) would come before the one
    # line this command prints about the failure; set before gRPC loads; GRPC_VERBOSITY=INFO shows them
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        parser.error("`serve` must come first: loraplex serve [server flags]")
    if args.command == "hash-token":
        return _hash_token()
    from loraplex.clients.errors import LoraplexClientError  # noqa: PLC0415
    from loraplex.clients.sync_client import LoraplexClient  # noqa: PLC0415

    try:
        tls = _tls(args)
        with LoraplexClient(args.address, timeout=args.timeout or DEFAULT_CALL_TIMEOUT, token=args.token,
                            tls=tls) as client:
            return _dispatch(client, args)
    except BrokenPipeError:  # `loraplex generate --json ... | head`: the reader left; stop quietly
        _quiet_closed_stdout()
        return EXIT_OK
    except LoraplexClientError as exc:
        # the server's message names the field first ("sampling.top_p: ..."): only a message that does not says it
        field = f" (field {exc.field})" if exc.field and not exc.details.startswith(f"{exc.field}:") else ""
        print(f"loraplex: {exc}{field}{_hint(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except UnicodeEncodeError as exc:  # the answer has a character stdout's encoding has not (a ValueError too)
        print(f"loraplex: the output's encoding ({exc.encoding}) cannot write {exc.object[exc.start:exc.end]!r}: "
              "set PYTHONIOENCODING=utf-8 or use a UTF-8 locale", file=sys.stderr)
        return EXIT_ERROR
    except (ValueError, TimeoutError, OSError) as exc:  # after BrokenPipeError, an OSError too
        print(f"loraplex: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _hint(exc: Exception) -> str:
    """The flag an error owes the user: a deadline was this client's own (--timeout); a token is
    given with --token (the server's words, "send 'authorization: Bearer <token>'", name none)."""
    from loraplex.clients.errors import DeadlineExceededError, UnauthenticatedError  # noqa: PLC0415

    if isinstance(exc, DeadlineExceededError):
        return " (this client's deadline ran out: pass a larger --timeout)"
    if isinstance(exc, UnauthenticatedError):
        return " (the token comes from --token or LORAPLEX_TOKEN)"
    return ""


def _quiet_closed_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not fail on the closed
    pipe again (Python's own advice for SIGPIPE, docs.python.org/3/library/signal.html)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
