"""CORS on real server processes (--http-cors-origins): a listed origin's preflight is answered
with the route's methods and the headers the API reads (and those the openai clients add), its
answers carry Access-Control-Allow-Origin, Vary: Origin and the X-Loraplex-* headers a page may
read (through the real openai client, whole, streamed and refused); an unlisted origin gets no
CORS headers; ``*`` answers any page; unset, nothing changes; a malformed origin stops the
server at start, naming it."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from hostile_helpers import Served, serve
from loraplex.inference_server.http.cors import CorsPolicy
from loraplex.inference_server.settings import ServerSettings
from server_process import REPO

PAGE = "https://chat.example.com"
LOCAL_PAGE = "http://localhost:3000"
STAINLESS = "x-stainless-os, x-stainless-lang, x-stainless-retry-count"  # what the openai JS client adds


@pytest.fixture(scope="module")
def listed(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(tiny_llama_dir, tmp_path_factory.mktemp("cors"), "--http-cors-origins",
                     f"{PAGE}, HTTP://LocalHost:3000")


def _request(served: Served, method: str, path: str, headers: dict[str, str],
             body: dict | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        if body is not None:
            headers = {**headers, "Content-Type": "application/json"}
        conn.request(method, path, None if body is None else json.dumps(body), headers)
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def _preflight(served: Served, path: str, origin: str, method: str = "POST",
               asked: str = "authorization, content-type") -> tuple[int, http.client.HTTPMessage]:
    status, headers, _ = _request(served, "OPTIONS", path, {"Origin": origin, "Access-Control-Request-Method": method,
                                                            "Access-Control-Request-Headers": asked})
    return status, headers


def _cors_headers(headers: http.client.HTTPMessage) -> list[str]:
    return [name for name in headers if name.lower().startswith("access-control-")]


def _words(value: str | None) -> set[str]:
    return {w.strip().lower() for w in (value or "").split(",") if w.strip()}


@pytest.mark.slow
@pytest.mark.parametrize(("path", "method", "methods"), [
    ("/v1/chat/completions", "POST", {"post"}), ("/v1/completions", "POST", {"post"}),
    ("/v1/models", "GET", {"get", "head"}), ("/v1/models/acme/pirate", "GET", {"get", "head"}),
])
def test_a_listed_origin_gets_its_preflight_answered(listed: Served, path: str, method: str,
                                                      methods: set[str]) -> None:
    status, headers = _preflight(listed, path, PAGE, method, f"Authorization, Content-Type, {STAINLESS}")
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == PAGE
    assert _words(headers["Access-Control-Allow-Methods"]) == methods
    assert _words(headers["Access-Control-Allow-Headers"]) >= {"authorization", "content-type"} | _words(STAINLESS)
    assert "origin" in _words(headers["Vary"]) and int(headers["Access-Control-Max-Age"]) > 0
    assert headers["Access-Control-Allow-Credentials"] is None  # bearer tokens, never cookies
    status, headers = _preflight(listed, path, LOCAL_PAGE, method)  # listed in another case and spelling
    assert status == 204 and headers["Access-Control-Allow-Origin"] == LOCAL_PAGE


@pytest.mark.slow
def test_a_listed_origin_reads_answers_and_refusals_through_the_openai_client(listed: Served) -> None:
    client = openai.OpenAI(base_url=listed.url("/v1"), api_key="unused", max_retries=0,
                           default_headers={"Origin": PAGE})
    raw = client.completions.with_raw_response.create(model=listed.base, prompt="hi", max_tokens=2,
                                                      extra_body={"guided_nonsense": 1})
    assert raw.status_code == 200 and raw.parse().choices
    assert raw.headers["access-control-allow-origin"] == PAGE and "origin" in _words(raw.headers["vary"])
    exposed = _words(raw.headers["access-control-expose-headers"])
    assert {"x-loraplex-ignored-fields", "retry-after"} <= exposed
    assert raw.headers["x-loraplex-ignored-fields"] == "guided_nonsense"
    with client.chat.completions.with_streaming_response.create(
            model=listed.base, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True) as stream:
        assert stream.headers["access-control-allow-origin"] == PAGE
        assert [c for c in stream.parse() if c.choices]
    with pytest.raises(openai.NotFoundError) as refused:  # a page reads why it was refused
        client.completions.create(model="nobody/nothing", prompt="hi", max_tokens=2)
    assert refused.value.response.headers["access-control-allow-origin"] == PAGE


@pytest.mark.slow
def test_an_unlisted_origin_gets_no_cors_headers(listed: Served) -> None:
    for origin in ("https://evil.example.com", "http://localhost:3001", "https://chat.example.com.evil.io", "null"):
        status, headers = _preflight(listed, "/v1/chat/completions", origin)
        assert status == 405 and _cors_headers(headers) == [], (origin, dict(headers))  # an OPTIONS, as before
        status, headers, _ = _request(listed, "POST", "/v1/completions", {"Origin": origin},
                                      {"model": listed.base, "prompt": "hi", "max_tokens": 2})
        assert status == 200 and _cors_headers(headers) == [], (origin, dict(headers))
        assert "origin" in _words(headers["Vary"])  # a cache must not hand this answer to a listed page
    status, headers, _ = _request(listed, "GET", "/v1/models", {})  # no Origin: not a browser's cross-origin call
    assert status == 200 and _cors_headers(headers) == [] and "origin" in _words(headers["Vary"])


@pytest.mark.slow
def test_a_preflight_to_a_route_the_server_does_not_serve_is_not_answered(listed: Served) -> None:
    for path in ("/v1/embeddings", "/v1/load_lora_adapter"):  # the latter: --allow-runtime-lora-updating off
        status, headers = _preflight(listed, path, PAGE)
        assert status == 404 and "Access-Control-Allow-Methods" not in headers


@pytest.mark.slow
def test_any_origin_with_star(tiny_llama_dir: Path, tmp_path: Path) -> None:
    process = serve(tiny_llama_dir, tmp_path, "--http-cors-origins", "*")
    served = next(process)
    try:
        status, headers = _preflight(served, "/v1/chat/completions", "https://anything.example.org")
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "*"
        assert _words(headers["Access-Control-Allow-Headers"]) >= {"authorization", "content-type"}
        client = openai.OpenAI(base_url=served.url("/v1"), api_key="unused", max_retries=0,
                               default_headers={"Origin": "http://127.0.0.1:5173"})
        raw = client.models.with_raw_response.list()
        assert raw.headers["access-control-allow-origin"] == "*"
        assert "origin" not in _words(raw.headers.get("vary"))  # the same answer for every page
    finally:
        process.close()


@pytest.mark.slow
def test_off_by_default_no_cors_headers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    process = serve(tiny_llama_dir, tmp_path)
    served = next(process)
    try:
        status, headers = _preflight(served, "/v1/chat/completions", PAGE)
        assert status == 405 and _cors_headers(headers) == []
        status, headers, _ = _request(served, "GET", "/v1/models", {"Origin": PAGE})
        assert status == 200 and _cors_headers(headers) == [] and headers["Vary"] is None
    finally:
        process.close()


@pytest.mark.parametrize("bad", ["https://chat.example.com/", "chat.example.com", "https://*.example.com",
                                 "null", "https://chat.example.com:99999", "https://ok.example.com,,",
                                 "*, https://chat.example.com", "https://chat.example.com/app"])
def test_a_malformed_origin_stops_the_server_at_start_naming_it(bad: str) -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "loraplex.inference_server.main", "--http-cors-origins", bad],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--http-cors-origins" in done.stderr and "LORAPLEX_HTTP_CORS_ORIGINS" in done.stderr
    named = bad.split(",")[0].strip() if bad.startswith("*") else bad
    assert repr(named) in done.stderr or "empty entry" in done.stderr, done.stderr


def test_the_setting_parses_from_flag_and_environment() -> None:
    assert ServerSettings.from_sources([], {}).http_cors_origins is None
    settings = ServerSettings.from_sources([], {"LORAPLEX_HTTP_CORS_ORIGINS": f"{PAGE},{PAGE}:443,http://[::1]:8080"})
    assert CorsPolicy.parse(settings.http_cors_origins).origins == (PAGE, "http://[::1]:8080")
    assert CorsPolicy.parse(ServerSettings.from_sources(["--http-cors-origins", "*"], {}).http_cors_origins).any_origin
    assert not CorsPolicy.parse("").enabled
