"""``loraplex generate``: its arguments (sampling, stopping, format) and the streamed answer."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

EXIT_OK, EXIT_CUT_OFF = 0, 1
CUT_OFF = ("abort", "error")  # finish reasons of an answer the server ended before it was done


def _logit_bias(text: str) -> tuple[int, float]:
    """A --logit-bias: TOKEN_ID=BIAS (e.g. 13=-100)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be TOKEN_ID=BIAS (e.g. 13=-100), got {text!r}") from None


def _adapter(text: str) -> str:
    """--adapter: an adapter id; empty is refused (an unset variable would silently mean the base model)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty adapter id (leave out --adapter for the base model)")
    return text


def _choices(text: str) -> int:
    """-n: a count of at least 1 (0 would go out as unset: one choice)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a count of at least 1, got {text!r}")
    return n


def add_generate_arguments(g: argparse.ArgumentParser) -> None:
    """``loraplex generate``'s arguments."""
    g.add_argument("prompt", help="the prompt ('-' reads stdin)")
    g.add_argument("--adapter", type=_adapter, default=None, help="adapter id (default: the base model)")
    mode = g.add_mutually_exclusive_group()  # a system message is a chat turn: --raw has none
    mode.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    mode.add_argument("--system", default=None, help="system message (chat mode)")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the top one")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None, help="1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2]")
    g.add_argument("--logit-bias", type=_logit_bias, action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS ([-100, 100]) to the token's logit (repeatable)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], metavar="ID",
                   help="stop at this token (repeatable)")
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS, stop token or stop string before this many")
    g.add_argument("--ignore-eos", action="store_true", help="go on past EOS (up to --max-new-tokens)")
    g.add_argument("-n", "--n", type=_choices, default=1, help="choices of the prompt (printed one after another)")
    structured = g.add_mutually_exclusive_group()  # one format: both ended in "pass json_schema or json_object"
    structured.add_argument("--json-schema", default=None, metavar="SCHEMA",
                            help="the answer is a document of this JSON schema (JSON text, or @file.json)")
    structured.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    g.add_argument("--json", action="store_true", help="print each event as a JSON line")
    g.add_argument("--quiet", action="store_true", help="no statistics line on stderr")


def _schema(text: str | None) -> str | None:
    """--json-schema's JSON text (``@path`` reads a file; one that cannot be read is named)."""
    if text is None or not text.startswith("@"):
        return text
    try:
        with open(text[1:], encoding="utf-8") as handle:
            return handle.read()
    except OSError as e:  # the message named neither the flag nor, for a bad byte, the file
        raise ValueError(f"--json-schema {text}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--json-schema {text}: not UTF-8 text (an undecodable byte at offset {e.start})") from None


def _prompt(args: argparse.Namespace) -> str:
    """The prompt text (``-``: stdin), refused unless valid UTF-8 (Python hands undecodable bytes
    on as lone surrogates, which only fail later as an encoding error naming no input) and unless
    it has some text (an unset variable or an empty file was answered from an empty chat turn)."""
    where = "stdin" if args.prompt == "-" else "the prompt argument"
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise ValueError(f"{where} is empty: nothing to answer")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} is not valid UTF-8 (an undecodable byte at character {e.start})") from None
    return prompt


def generate(client: Any, args: argparse.Namespace) -> int:
    """Stream the answer to stdout (``-n`` > 1: each choice whole, one after another; ``--json``: an
    event a line) and a statistics line to stderr. Exit 1, naming it on stderr, when the server
    ended a choice before it was done (finish reason abort or error: the answer is cut off)."""
    from loraplex.clients.errors import LoraplexClientError  # noqa: PLC0415 (gRPC loads after GRPC_VERBOSITY is set)

    prompt = _prompt(args)
    kwargs: dict[str, Any] = dict(
        adapter=args.adapter, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias), stop=args.stop, stop_token_ids=args.stop_token_id,
        min_tokens=args.min_tokens, ignore_eos=args.ignore_eos, n=args.n, json_schema=_schema(args.json_schema),
        json_object=args.json_object, timeout=args.timeout)
    if args.raw:
        kwargs["prompt"] = prompt
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        kwargs["messages"] = [*system, {"role": "user", "content": prompt}]
    start, tokens, last = time.perf_counter(), 0, None
    texts: dict[int, list[str]] = {}  # n > 1: each choice's text, printed whole at the end
    finished: dict[int, str] = {}
    streamed = not args.json and args.n <= 1  # text goes out as it comes; its line ends with the answer
    try:
        with _ctrl_c_noted() as ctrl_c:
            for event in client.generate(**kwargs):
                ctrl_c.check()
                tokens += len(event.token_ids)
                last = event
                if event.finish_reason:
                    finished[event.index] = event.finish_reason
                if args.json:
                    print(json.dumps(asdict(event)), flush=True)
                elif not streamed:
                    texts.setdefault(event.index, []).append(event.text)
                else:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            ctrl_c.check()
    except (LoraplexClientError, KeyboardInterrupt):
        if streamed and last is not None:  # the error (or the shell's prompt) starts a line of its own
            print(flush=True)
        raise
    for index in sorted(texts):
        sys.stdout.write(f"[choice {index}]\n{''.join(texts[index])}\n")
    if streamed:
        sys.stdout.write("\n")
    if not args.quiet and last is not None:
        elapsed = time.perf_counter() - start
        ttft = f", first token {last.timings.ttft_s:.3f}s" if last.timings else ""
        print(f"[{last.finish_reason}: {tokens} tokens in {elapsed:.2f}s{ttft}, {tokens / max(elapsed, 1e-9):.1f} tok/s]",
              file=sys.stderr)
    cut = {i: reason for i, reason in sorted(finished.items()) if reason in CUT_OFF}
    if cut:
        which = ", ".join(f"choice {i} ({reason})" for i, reason in cut.items()) if args.n > 1 else next(
            iter(cut.values()))
        print(f"loraplex: the server ended the answer before it was done: {which}; the output is cut off",
              file=sys.stderr)
        return EXIT_CUT_OFF
    return EXIT_OK


class _CtrlC:
    """A Ctrl-C seen while a stream ran (``check`` raises it again)."""

    def __init__(self) -> None:
        self.seen = threading.Event()

    def check(self) -> None:
        if self.seen.is_set():
            raise KeyboardInterrupt


@contextmanager
def _ctrl_c_noted() -> Iterator[_CtrlC]:
    """SIGINT raises KeyboardInterrupt as always, and is noted: one raised while gRPC's Cython code
    runs can be swallowed there as "unraisable" (a CI run once streamed on to the end and exited 0),
    so the loop raises it again at its next event or its end, and that swallowed one prints nothing.
    Main thread only (elsewhere: nothing changes)."""
    ctrl_c = _CtrlC()

    def interrupted(signum: int, frame: Any) -> None:
        ctrl_c.seen.set()
        raise KeyboardInterrupt

    def unraisable(info: Any) -> None:
        if not isinstance(info.exc_value, KeyboardInterrupt):
            previous_hook(info)

    if threading.current_thread() is not threading.main_thread():
        yield ctrl_c
        return
    previous, previous_hook = signal.signal(signal.SIGINT, interrupted), sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        yield ctrl_c
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
