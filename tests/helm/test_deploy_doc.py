"""docs/DEPLOY.md as a reader would follow it: its systemd units pass `systemd-analyze verify`;
each unit's command with the environment files the page gives (and the TLS and token additions)
makes valid settings, with no two processes on one port; and its TLS recipe (openssl) makes
certificates the server, the CLI and the openai client accept. tests/project/test_docs.py checks its
commands' flags and variables like every doc's, tests/helm/test_run_stack.py runs the layout."""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from doc_sources import Block, fenced_blocks, shell_lines, split_commands, unit_lines
from server_helpers import FakeEngine, ServerThread

from loraplex.adapter_store.main import parse_args as store_settings
from loraplex.clients import LoraplexClient, TlsConfig, TransportMismatchError
from loraplex.inference_server.auth.security import Security, TlsFiles
from loraplex.inference_server.server.app import ServerOptions
from loraplex.inference_server.settings import ServerSettings

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "DEPLOY.md"
BLOCKS = fenced_blocks(DEPLOY)


def _titled(lang: tuple[str, ...]) -> list[tuple[str, Block]]:
    """(the first line's comment, block) of the blocks in ``lang`` that start with one."""
    return [(b.text.splitlines()[0].lstrip("# ").strip(), b) for b in BLOCKS
            if b.lang in lang and b.text.startswith("#")]


UNITS = {title.rsplit("/", 1)[1]: block for title, block in _titled(("ini",))}
ENV_FILES = _titled(("sh",))


def _env(block: Block) -> dict[str, str]:
    return dict(line.split("=", 1) for line in block.text.splitlines() if re.match(r"[A-Z_]+=", line))


def _command(unit: str) -> list[str]:
    (line, text), = unit_lines(UNITS[unit])
    (command,) = split_commands(text, f"{unit}:{line}")
    return list(command.args)


def _env_file(name: str) -> dict[str, str]:
    return _env(next(b for title, b in ENV_FILES if title.startswith(name)))


def _additions() -> dict[str, str]:
    """What the TLS and Tokens sections add to every server's environment file."""
    out: dict[str, str] = {}
    for title, block in ENV_FILES:
        if title.startswith("added to"):
            out.update(_env(block))
    return out


def test_the_page_has_the_units_and_files_this_test_reads() -> None:
    assert set(UNITS) == {"loraplex-store.service", "loraplex-server@.service"}
    assert {"/etc/loraplex/store.env", "/etc/loraplex/server-0.env"} <= {t.split()[0] for t, _ in ENV_FILES}
    assert {"LORAPLEX_TLS_CERT_FILE", "LORAPLEX_AUTH"} <= set(_additions())


def test_each_unit_with_its_environment_makes_valid_settings_on_distinct_ports() -> None:
    store, _ = store_settings(_command("loraplex-store.service"), env=_env_file("/etc/loraplex/store.env"))
    assert store.listen == "127.0.0.1:50061" and store.redis is not None and store.secret_file
    ports = {"store": int(store.listen.rsplit(":", 1)[1]), "store metrics": store.metrics_port}
    for n in (0, 1):
        env = {**_env_file(f"/etc/loraplex/server-{n}.env"), **_additions()}
        server = ServerSettings.from_sources(_command("loraplex-server@.service"), env=env)
        assert server.adapter_store == store.listen and server.adapter_store_secret_file == store.secret_file
        assert server.tls_cert_file and server.auth == "tokens" and server.device == f"cuda:{n}"
        for name in ("port", "http_port", "metrics_port"):
            ports[f"server {n} {name}"] = getattr(server, name)
    for n, health in enumerate(re.findall(r"`LORAPLEX_HEALTH_PORT=(\d+)`", DEPLOY.read_text())):
        ports[f"server {n} health_port"] = int(health)
    assert len(ports) == 10 and len(set(ports.values())) == len(ports), f"two processes on one port: {ports}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze on this machine")
def test_the_units_verify(tmp_path: Path) -> None:
    bin_dir = str(Path(sys.executable).parent)
    for name, block in UNITS.items():
        text = block.text.replace("/opt/loraplex/bin", bin_dir)  # executables that exist here
        (tmp_path / name).write_text(text)
        checked = name.replace("@.", "@0.")  # a template is verified as an instance
        if checked != name:
            (tmp_path / checked).write_text(text)
        out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / checked)], capture_output=True, text=True,
                             timeout=60)
        complaints = [line for line in (out.stdout + out.stderr).splitlines() if checked in line or name in line]
        assert out.returncode == 0 and not complaints, out.stdout + out.stderr


@pytest.mark.slow  # starts a server
def test_the_tls_recipe_makes_certificates_the_server_and_clients_accept(tmp_path: Path) -> None:
    import openai

    recipe = next(b for b in BLOCKS if b.lang == "bash" and "openssl req -x509" in b.text)
    script = "\n".join(line for _, line in shell_lines(recipe) if not line.startswith("sudo "))
    out = subprocess.run(["bash", "-ec", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    security = Security(tls=TlsFiles(str(tmp_path / "server.pem"), str(tmp_path / "server-key.pem")))
    srv = ServerThread(ServerOptions(port=0), security=security)
    try:
        url = srv.start_http()
        srv.attach(FakeEngine(tmp_path / "adapters"))
        for host in ("127.0.0.1", "localhost"):
            with LoraplexClient(f"{host}:{srv.port}", timeout=5, retry_attempts=1,
                                tls=TlsConfig(str(tmp_path / "ca.pem"))) as client:
                assert client.health() == "SERVING"
        with LoraplexClient(srv.address, timeout=5, retry_attempts=1) as plaintext, \
                pytest.raises(TransportMismatchError, match="pass --tls-root-cert"):
            plaintext.health()
        trusting = openai.OpenAI(base_url=url, api_key="-", max_retries=0, http_client=openai.DefaultHttpxClient(
            verify=ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))))
        assert [m.id for m in trusting.models.list()] == ["fake-llama"]
    finally:
        srv.close()
