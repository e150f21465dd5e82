"""``loraplex-server`` as a real process (tiny random Llama; one running slot, one waiting) driven
by the ``openai`` client and LoraplexClient, its metrics read from ``--metrics-port``: what the
counters say against what the API answered."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.clients import LoraplexClient
from loraplex.clients.errors import DeadlineExceededError, NotFoundError
from server_helpers import free_port
from server_process import start_server, stop

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Served:
    address: str  # gRPC
    url: str  # the OpenAI API's base URL
    metrics_url: str

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample: (name, sorted labels) -> value."""
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("metrics-server")
    http, metrics = free_port(), free_port()
    proc, address = start_server(tiny_llama_dir, tmp, "--http-port", str(http), "--metrics-port", str(metrics),
                                 "--max-num-seqs", "1", "--max-waiting", "1")
    try:
        with LoraplexClient(address, retry_attempts=1, timeout=2) as client:
            client.wait_until_serving(120)
        yield Served(address, f"http://127.0.0.1:{http}/v1", f"http://127.0.0.1:{metrics}/metrics")
    finally:
        stop(proc)


def _wait_idle(served: Served) -> dict:
    deadline = time.monotonic() + 60
    while True:
        samples = served.scrape()
        if _value(samples, "loraplex_running_requests") == 0 and _value(samples, "loraplex_queue_length") == 0:
            return samples
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def test_refused_requests_count_no_prompt_tokens_and_taken_ones_count_their_usage(served: Served) -> None:
    """A request the engine refuses (an unknown adapter: 404 / NOT_FOUND; a full queue: 429)
    computed no prompt: loraplex_prompt_tokens_total and the tenant's requests and prompt tokens
    move by exactly the usage of the requests that ran."""
    before = _wait_idle(served)
    client = openai.OpenAI(base_url=served.url, api_key="x", max_retries=0, timeout=120)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="Hello there, friend", max_tokens=3)
    with LoraplexClient(served.address) as grpc_client, pytest.raises(NotFoundError):
        grpc_client.generate_text("Hello there, friend", adapter="no-such-adapter", max_new_tokens=3)

    base = client.models.list().data[0].id
    usages: list = []

    def long_one() -> None:
        usages.append(client.completions.create(model=base, prompt="Count to a thousand.", max_tokens=400,
                                                extra_body={"ignore_eos": True}).usage)

    threads = [threading.Thread(target=long_one) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not (_value(served.scrape(), "loraplex_running_requests") == 1
               and _value(served.scrape(), "loraplex_queue_length") == 1):
        assert time.monotonic() < deadline, "the two long requests never filled the engine"
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError):  # the running slot and the waiting slot are taken
        client.completions.create(model=base, prompt="Hello there, friend", max_tokens=3)
    for t in threads:
        t.join(120)
    after = _wait_idle(served)

    assert len(usages) == 2
    prompt = sum(u.prompt_tokens for u in usages)

    def moved(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert moved("loraplex_http_requests_total", route="/v1/completions", status="404") == 1
    assert moved("loraplex_http_requests_total", route="/v1/completions", status="429") == 1
    assert moved("loraplex_prompt_tokens_total") == prompt
    assert moved("loraplex_tenant_generate_requests_total", tenant="anonymous") == 2
    assert moved("loraplex_tenant_tokens_total", tenant="anonymous", kind="prompt") == prompt
    assert moved("loraplex_tenant_tokens_total", tenant="anonymous", kind="generated") == 800
    assert moved("loraplex_generated_tokens_total") == sum(u.completion_tokens for u in usages) == 800


def test_a_generate_whose_deadline_passed_counts_as_deadline_exceeded(served: Served) -> None:
    """The client's deadline passes first (the server set its copy when the call arrived): its
    cancellation lands while the server still sees a few ms left. Counted as the client saw it,
    DEADLINE_EXCEEDED, as docs/HTTP.md says; a call cancelled well before its deadline stays
    CANCELLED."""
    before = _wait_idle(served)
    with LoraplexClient(served.address) as client:
        client.health()  # connected: a call's deadline runs from its start, not from the connection's
        for _ in range(3):
            with pytest.raises(DeadlineExceededError):
                list(client.generate("Count forever.", max_new_tokens=1500, ignore_eos=True, timeout=0.5))
        # a client a transit ahead of the server: it cancels 20 ms before the deadline it sent (or
        # its deadline passes first, on a slow machine: the same call as far as the server knows)
        start = time.monotonic()
        events = client.generate("Count forever.", max_new_tokens=1500, ignore_eos=True, timeout=3.0)
        with contextlib.suppress(DeadlineExceededError):
            for _ in events:
                if time.monotonic() - start >= 2.98:
                    break
        events.close()
        events = client.generate("Count forever.", max_new_tokens=1500, ignore_eos=True, timeout=30.0)
        next(events)
        events.close()
    after = _wait_idle(served)
    for code, calls in (("DEADLINE_EXCEEDED", 4), ("CANCELLED", 1)):
        labels = dict(method="Generate", code=code)
        assert _value(after, "loraplex_rpc_requests_total", **labels) - _value(
            before, "loraplex_rpc_requests_total", **labels) == calls, code
