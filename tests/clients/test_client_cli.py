"""The ``loraplex`` CLI against a server with a fake engine: output a user reads, exit codes."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
from pathlib import Path

import pytest

from loraplex.clients.cli import main
from loraplex.inference_server.server.app import ServerOptions
from server_helpers import (
    ByteTokenizer, FakeEngine, ServerThread, fake_server_address, fake_tokens, write_fake_adapter,
)


@pytest.fixture
def address(tmp_path: Path):
    yield from fake_server_address(tmp_path)


def run(capsys, address: str, *argv: str) -> tuple[int, str, str]:
    code = main(["--address", address, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_prints_the_text_and_a_stats_line(capsys, address: str) -> None:
    code, out, err = run(capsys, address, "generate", "--raw", "hey", "--max-new-tokens", "5")
    expected = ByteTokenizer().decode(fake_tokens(tuple(ByteTokenizer().encode("hey")), None, 5))
    assert code == 0 and out == expected + "\n"
    assert "[length: 5 tokens" in err


def test_generate_chat_mode_json_lines(capsys, address: str) -> None:
    code, out, err = run(capsys, address, "generate", "hey", "--system", "be brief", "--json", "--quiet")
    events = [json.loads(line) for line in out.splitlines()]
    prompt = ByteTokenizer().apply_chat_template([{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "hey"}])
    assert [t for e in events for t in e["token_ids"]] == fake_tokens(tuple(prompt), None, 6)
    assert events[-1]["finish_reason"] == "length" and err == ""


def test_adapters_upload_list_show_delete(capsys, address: str, tmp_path: Path) -> None:
    folder = write_fake_adapter(tmp_path / "pirate")
    code, out, err = run(capsys, address, "adapters", "upload", "pirate", str(folder))
    assert code == 0 and out.startswith("uploaded pirate (version ") and "uploading pirate" in err
    code, out, _ = run(capsys, address, "adapters", "list")
    header, row = out.splitlines()
    assert header.split() == ["ID", "VISIBILITY", "RANK", "ALPHA", "DTYPE", "BYTES", "VERSION", "TARGETS"]
    assert row.split()[:5] == ["pirate", "shared", "4", "8", "F32"] and row.split()[-1] == "q_proj,v_proj"
    code, out, _ = run(capsys, address, "adapters", "show", "pirate")
    assert json.loads(out)["rank"] == 4
    assert run(capsys, address, "adapters", "delete", "pirate")[:2] == (0, "deleted pirate\n")
    code, out, err = run(capsys, address, "adapters", "show", "pirate")
    assert code == 1 and "NOT_FOUND" in err and "pirate" in err


def test_upload_public_and_back_to_private_shows_in_list_and_show(capsys, address: str, tmp_path: Path) -> None:
    folder = write_fake_adapter(tmp_path / "pirate")
    code, out, _ = run(capsys, address, "adapters", "upload", "--public", "acme/pirate", str(folder))
    assert code == 0 and out.rstrip().endswith("bytes, public)")
    _, out, _ = run(capsys, address, "adapters", "list")
    assert out.splitlines()[1].split()[:2] == ["acme/pirate", "public"]
    _, out, _ = run(capsys, address, "adapters", "list", "--json")
    assert json.loads(out)["public"] is True
    code, out, _ = run(capsys, address, "adapters", "upload", "acme/pirate", str(folder))  # without --public
    assert code == 0 and out.rstrip().endswith("bytes, private)")
    _, out, _ = run(capsys, address, "adapters", "list")
    assert out.splitlines()[1].split()[:2] == ["acme/pirate", "private"]
    _, out, _ = run(capsys, address, "adapters", "show", "acme/pirate")
    assert json.loads(out)["public"] is False
    run(capsys, address, "adapters", "delete", "acme/pirate")


def test_errors_exit_1_naming_the_field(capsys, address: str) -> None:
    code, out, err = run(capsys, address, "generate", "x", "--top-p", "2")
    assert code == 1 and "INVALID_ARGUMENT: sampling.top_p: " in err and err.count("sampling.top_p") == 1, err


def test_health_and_info(capsys, address: str) -> None:
    assert run(capsys, address, "health") == (0, "SERVING\n", "")
    code, out, _ = run(capsys, address, "info")
    assert code == 0 and json.loads(out)["model_name"] == "fake-llama"


def test_unreachable_server_is_a_clean_error(capsys) -> None:
    code = main(["--address", "127.0.0.1:1", "--timeout", "2", "health"])
    assert code == 1 and "UNAVAILABLE" in capsys.readouterr().err


def test_a_wait_for_a_server_that_is_down_says_it_is_down(capsys) -> None:
    """The last poll, cut short by the wait's end while gRPC retried the refused connection, ended
    the wait with "last: DEADLINE_EXCEEDED", as if the server were up but slow."""
    assert main(["--address", "127.0.0.1:1", "health", "--wait", "4"]) == 1
    err = capsys.readouterr().err
    assert "not SERVING after 4s (last: UNAVAILABLE" in err and "DEADLINE_EXCEEDED" not in err, err


def test_upload_of_a_missing_folder_is_a_clean_error(capsys, address: str, tmp_path: Path) -> None:
    code, _, err = run(capsys, address, "adapters", "upload", "x", str(tmp_path / "nope"))
    assert code == 1 and err == f"loraplex: {tmp_path / 'nope'}: not a folder\n"  # no progress bar first


def test_bad_arguments_name_the_option_before_any_call(capsys, address: str) -> None:
    """Out-of-range numbers name their option (protobuf only said "Value out of range: -3"), a
    timeout must be > 0 seconds, and a port past 65535 is refused (the resolver took it modulo
    65536 and the error named another port)."""
    code, _, err = run(capsys, address, "generate", "x", "--max-new-tokens", "-3")
    assert code == 1 and "max_new_tokens: Value out of range: -3" in err
    code, _, err = run(capsys, address, "generate", "x", "--seed", "-1")
    assert code == 1 and err.startswith("loraplex: seed:")
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit) as exit_:
            main(["--address", address, "--timeout", bad, "health"])
        assert exit_.value.code == 2 and "must be a number of seconds > 0" in capsys.readouterr().err
    assert main(["--address", "127.0.0.1:99999", "health"]) == 1
    assert "port 99999 is outside 1-65535" in capsys.readouterr().err
    for bad in ("0", "-1"):  # 0 went out as unset (one choice), -1 as protobuf's words
        with pytest.raises(SystemExit) as exit_:
            main(["--address", address, "generate", "x", "-n", bad])
        assert exit_.value.code == 2 and "-n/--n: must be a count of at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # a system message is a chat turn: --raw sent the text without it
        main(["--address", address, "generate", "x", "--raw", "--system", "be brief"])
    assert exit_.value.code == 2 and "not allowed with argument --raw" in capsys.readouterr().err


def test_an_upload_that_fails_on_the_client_side_says_why(address: str, tmp_path: Path) -> None:
    """A progress callback that raises, or a file that vanishes mid-upload, surfaces as itself,
    not as gRPC's "Exception iterating requests!" (UNKNOWN)."""
    from loraplex.clients.sync_client import LoraplexClient

    folder = write_fake_adapter(tmp_path / "a")

    def explode(sent: int, total: int) -> None:
        raise RuntimeError("progress bar broke")

    def vanish(sent: int, total: int) -> None:
        (folder / "adapter_model.safetensors").unlink(missing_ok=True)

    with LoraplexClient(address) as client:
        with pytest.raises(RuntimeError, match="progress bar broke"):
            client.upload_adapter("t/a", folder, progress=explode)
        with pytest.raises(FileNotFoundError):
            client.upload_adapter("t/a", folder, progress=vanish)
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with string 'role' and 'content'"):
        from loraplex.clients.requests import generate_request

        generate_request(messages=[{"content": "x"}])


def test_a_generate_past_its_timeout_says_the_limit_was_the_clients(capsys, tmp_path: Path) -> None:
    """`generate --timeout` bounds the whole stream; when it runs out the message says it was this
    client's deadline and names the flag (a bare DEADLINE_EXCEEDED reads like a server fault); the
    text printed before it ends its line, so the error does not continue the answer's line."""
    from server_helpers import FakeEngine, ServerOptions, ServerThread

    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=6))
    srv.attach(FakeEngine(tmp_path / "store", step_s=0.05))
    try:
        code, out, err = run(capsys, srv.address, "--timeout", "0.5", "generate", "--raw", "hey",
                             "--max-new-tokens", "200")
    finally:
        srv.close()
    assert code == 1 and "DEADLINE_EXCEEDED" in err and "--timeout" in err
    assert 0 < len(out) < 200  # the tokens that came before the deadline were printed
    assert out.endswith("\n")  # their line ends: the error line was glued to it on a terminal


def test_an_answer_the_server_cut_off_exits_1_naming_it(capsys, tmp_path: Path) -> None:
    """A stream the server ended with finish reason abort (a drain, an operator's abort) exited 0,
    so a script could not tell a cut-off answer from a whole one; with --quiet nothing said so."""
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=200))
    engine = FakeEngine(tmp_path / "store", step_s=0.02)
    srv.attach(engine)

    def abort_soon() -> None:
        while not engine.requests:
            time.sleep(0.01)
        time.sleep(0.1)
        engine.abort(engine.requests[-1].request_id)

    try:
        for quiet in ((), ("--quiet",)):
            engine.requests.clear()
            thread = threading.Thread(target=abort_soon)
            thread.start()
            code = main(["--address", srv.address, "generate", *quiet, "--raw", "hey", "--max-new-tokens", "200"])
            thread.join()
            err = capsys.readouterr().err
            assert code == 1 and "loraplex: the server ended the answer before it was done: abort" in err, err
        code, _, err = run(capsys, srv.address, "generate", "--raw", "hey", "--max-new-tokens", "3")
        assert code == 0 and "ended the answer" not in err
    finally:
        srv.close()


def test_hash_token_refuses_a_token_servers_refuse(capsys, monkeypatch) -> None:
    """It hashed an 8-character token the server then refused as malformed on every call."""
    for bad in ("shorttok", "sixteen chars with spaces", "é" * 20):
        monkeypatch.setattr("sys.stdin", io.StringIO(bad + "\n"))
        assert main(["hash-token"]) == 2
        assert "servers refuse this token" in capsys.readouterr().err
    good = "a-token-of-24-characters"
    monkeypatch.setattr("sys.stdin", io.StringIO(good + "\n"))
    assert main(["hash-token"]) == 0
    assert capsys.readouterr().out.strip() == hashlib.sha256(good.encode()).hexdigest()


def test_an_upload_honours_the_timeout_given(capsys, address: str, tmp_path: Path) -> None:
    """--timeout was raised to at least 600 s for uploads, silently."""
    folder = write_fake_adapter(tmp_path / "ad")
    code, _, err = run(capsys, address, "--timeout", "0.001", "adapters", "upload", "acme/slow", str(folder))
    assert code == 1 and "DEADLINE_EXCEEDED" in err and "--timeout" in err


def test_prompt_and_adapter_input_mistakes_are_named(capsys, address: str, monkeypatch) -> None:
    """Undecodable bytes in a prompt ended with "'utf-8' codec can't encode ... surrogates"; an
    empty prompt (an unset variable, an empty file on stdin) was answered in chat mode; an
    empty --adapter (an unset variable) answered from the base model; an empty LORAPLEX_ADDRESS
    was taken as the address."""
    code, _, err = run(capsys, address, "generate", "--raw", "Hi \udcff there")
    assert code == 1 and "the prompt argument is not valid UTF-8" in err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Hi \xff there"), errors="surrogateescape"))
    code, _, err = run(capsys, address, "generate", "--raw", "-")
    assert code == 1 and "stdin is not valid UTF-8" in err
    for mode in ((), ("--raw",)):  # chat mode answered an empty turn; --raw said only "text: must be non-empty"
        assert run(capsys, address, "generate", *mode, "") == (1, "", "loraplex: the prompt argument is empty: "
                                                                       "nothing to answer\n")
        monkeypatch.setattr("sys.stdin", io.StringIO(" \n"))
        assert run(capsys, address, "generate", *mode, "-")[::2] == (1, "loraplex: stdin is empty: nothing to answer\n")
    with pytest.raises(SystemExit) as exit_:
        main(["--address", address, "generate", "--adapter", "", "hi"])
    assert exit_.value.code == 2 and "empty adapter id" in capsys.readouterr().err
    monkeypatch.setenv("LORAPLEX_ADDRESS", "")
    from loraplex.clients.cli import build_parser
    from loraplex.clients.requests import DEFAULT_ADDRESS
    assert build_parser().parse_args(["health"]).address == DEFAULT_ADDRESS


def test_ctrl_c_before_the_call_exits_130_without_a_traceback(monkeypatch) -> None:
    from loraplex.clients import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["health"]) == 130


def test_a_health_wait_that_is_no_number_of_seconds_is_refused(capsys, address: str) -> None:
    """--wait -5 and --wait nan asked once and did not wait, silently (only > 0 waited)."""
    for bad in ("-5", "nan", "inf"):
        with pytest.raises(SystemExit) as exit_:
            main(["--address", address, "health", "--wait", bad])
        assert exit_.value.code == 2 and "--wait: must be a number of seconds >= 0" in capsys.readouterr().err
    assert run(capsys, address, "health", "--wait", "0") == (0, "SERVING\n", "")


def test_a_json_schema_file_that_cannot_be_read_is_named(capsys, address: str, tmp_path: Path) -> None:
    """`--json-schema @file` said "[Errno 2] No such file or directory" (no flag), or for a file not in
    UTF-8 "'utf-8' codec can't decode byte 0xff ..." (no file); with --json-object too it said
    "pass json_schema or json_object, not both", Python's names, not the flags."""
    binary = tmp_path / "schema.json"
    binary.write_bytes(b"\xff\xfe{}")
    code, _, err = run(capsys, address, "generate", "--json-schema", f"@{tmp_path / 'nope.json'}", "hi")
    assert (code, err) == (1, f"loraplex: --json-schema @{tmp_path / 'nope.json'}: cannot read (No such file or "
                              "directory)\n")
    code, _, err = run(capsys, address, "generate", "--json-schema", f"@{binary}", "hi")
    assert code == 1 and err.startswith(f"loraplex: --json-schema @{binary}: not UTF-8 text"), err
    with pytest.raises(SystemExit) as exit_:
        main(["--address", address, "generate", "--json-schema", "{}", "--json-object", "hi"])
    assert exit_.value.code == 2 and "not allowed with argument --json-schema" in capsys.readouterr().err


def test_a_url_for_an_address_is_named(capsys) -> None:
    """`--address http://127.0.0.1:8000/v1` (the HTTP API's base URL) failed as gRPC's "Misformatted
    domain name"; it names the host:port to pass instead, and TLS for https."""
    from loraplex.clients.sync_client import LoraplexClient

    assert main(["--address", "http://127.0.0.1:8000/v1", "health"]) == 1
    assert capsys.readouterr().err == ("loraplex: address 'http://127.0.0.1:8000/v1' is a URL: a gRPC address is "
                                       "host:port, e.g. '127.0.0.1:8000'\n")
    with pytest.raises(ValueError, match=r"is a URL: .* e.g. 'api.example.com:443' with TLS"):
        LoraplexClient("https://api.example.com:443")


def test_a_missing_or_unknown_token_names_the_flag(capsys, tmp_path: Path) -> None:
    """The server says "missing credentials: send 'authorization: Bearer <token>'", the wire's words:
    the CLI's user passes --token or LORAPLEX_TOKEN, which nothing named."""
    from tenant_tokens import TOKENS, write_tokens

    from loraplex.inference_server.auth.security import Security
    from loraplex.inference_server.auth.tokens import TokenFile

    write_tokens(tmp_path / "tokens.json", TOKENS)
    srv = ServerThread(ServerOptions(port=0), security=Security(tokens=TokenFile(str(tmp_path / "tokens.json"))))
    srv.attach(FakeEngine(tmp_path / "store"))
    try:
        for token in ((), ("--token", "not-a-token-the-server-knows")):
            code, _, err = run(capsys, srv.address, *token, "info")
            assert code == 1 and "UNAUTHENTICATED" in err and "--token or LORAPLEX_TOKEN" in err, err
        assert run(capsys, srv.address, "--token", TOKENS["a"], "adapters", "list")[0] == 0
    finally:
        srv.close()


def test_ctrl_c_during_a_stream_exits_130_at_once_without_a_traceback(tmp_path: Path) -> None:
    """SIGINT mid-answer (a real process: gRPC's stream wait must let the signal through)."""
    import signal
    import subprocess
    import sys

    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=6))
    srv.attach(FakeEngine(tmp_path / "store", step_s=0.05))
    try:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "loraplex.clients.cli", "--address", srv.address,
                                 "generate", "--raw", "hey", "--max-new-tokens", "200"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout.read(1), proc.communicate()  # streaming
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        srv.close()
    assert proc.returncode == 130 and time.monotonic() - started < 5
    assert err == b"" and out.endswith(b"\n"), err


def test_an_answer_the_output_encoding_cannot_write_names_the_fix(address: str, monkeypatch, capsys) -> None:
    """On an ASCII or cp1252 stdout (a C locale, a redirect on Windows) the answer stopped at its
    first such character with "'ascii' codec can't encode character ...", naming no fix."""

    class NarrowOut(io.StringIO):
        def write(self, text: str) -> int:  # as a stdout whose encoding has none of the answer's characters
            if text:
                raise UnicodeEncodeError("ascii", text, 0, 1, "ordinal not in range(128)")
            return 0

    monkeypatch.setattr("sys.stdout", NarrowOut())
    code = main(["--address", address, "generate", "--raw", "hey"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("loraplex: the output's encoding (ascii) cannot write ") and \
        err.endswith(": set PYTHONIOENCODING=utf-8 or use a UTF-8 locale\n"), err


def test_a_ctrl_c_that_grpc_swallowed_still_ends_the_stream_with_130(address: str, capsys, monkeypatch) -> None:
    """A KeyboardInterrupt raised while gRPC's Cython code runs can be swallowed there (printed as
    unraisable): the stream went on to its end and the CLI exited 0 (seen once in CI, under load).
    The CLI notes the signal too and ends at the next event, exit 130, its line ended, no noise."""
    import os
    import signal

    from loraplex.clients.sync_client import LoraplexClient

    real = LoraplexClient.generate

    def swallowing(self, *args, **kwargs):
        for i, event in enumerate(real(self, *args, **kwargs)):
            if i == 1:
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.2)
                except KeyboardInterrupt:
                    pass  # as gRPC's Cython layer does with an exception it cannot raise
            yield event

    monkeypatch.setattr(LoraplexClient, "generate", swallowing)
    code, out, err = run(capsys, address, "generate", "--raw", "hey", "--max-new-tokens", "20")
    assert code == 130 and out.endswith("\n") and err == "", (code, out, err)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
