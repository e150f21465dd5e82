"""Third-party clients against a real ``loraplex-server`` process serving SmolLM2-135M-Instruct on
the CPU (#41 item 5): guidellm's streaming benchmark and kubernetes-sigs' inference-perf run to
completion with non-zero, sane figures read from their reports (guidellm exits 0 even when every
request failed), and LangChain's ChatOpenAI invokes, streams, answers in a JSON schema and calls a
tool. Each tool gets what it needs offline: a tokenizer folder written from the GGUF.

inference-perf needs Python >= 3.12: its test installs it (pinned) into a venv of its own, made with
the first Python >= 3.12 on the machine and kept under ~/.cache/loraplex-tests, or skips saying so."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from server_helpers import free_port
from server_process import start_server, stop

pytestmark = pytest.mark.slow

INFERENCE_PERF = "inference-perf==0.7.0"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def server(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory):
    """(HTTP base URL without /v1, the base model's name) of a server process on SmolLM2."""
    tmp = tmp_path_factory.mktemp("third-party")
    port = free_port()
    proc, _ = start_server(Path(smollm2_gguf), tmp, "--http-port", str(port))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, (tmp / "server.log").read_text()
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                model = json.loads(r.read())["data"][0]["id"]
            break
        except (urllib.error.URLError, OSError):
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
    yield base, model
    stop(proc)


def test_langchain_invoke_stream_structured_output_and_tools(server) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    base, model = server
    chat = ChatOpenAI(base_url=base + "/v1", api_key="unused", model=model, temperature=0, max_tokens=24,
                      max_retries=0, timeout=120)
    answer = chat.invoke("What is the capital of France?")
    assert "Paris" in answer.content and answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.usage_metadata["output_tokens"] > 0 and answer.usage_metadata["input_tokens"] > 0
    chunks = list(chat.stream("What is the capital of France?"))
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == answer.content  # greedy: the same text

    class Capital(BaseModel):
        city: str = Field(max_length=30)
        country: str = Field(max_length=30)

    capital = chat.with_structured_output(Capital, method="json_schema").invoke(
        "What is the capital of France? Answer as JSON.")
    assert isinstance(capital, Capital) and capital.city

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    tools = ChatOpenAI(base_url=base + "/v1", api_key="unused", model=model, temperature=0, max_tokens=60,
                       max_retries=0, timeout=120).bind_tools([get_weather], tool_choice="get_weather")
    call = tools.invoke("What is the weather in Paris?")
    assert [c["name"] for c in call.tool_calls] == ["get_weather"] and isinstance(call.tool_calls[0]["args"]["city"],
                                                                                   str)


def test_guidellm_streaming_benchmark_completes_with_sane_figures(server, smollm2_tokenizer_dir: Path,
                                                                  tmp_path: Path) -> None:
    guidellm = shutil.which("guidellm", path=os.path.dirname(sys.executable))
    assert guidellm, "guidellm is in the test extra (pip install -e '.[test]')"
    base, model = server
    report = tmp_path / "report.json"
    run = subprocess.run(
        [guidellm, "run", "--backend", f"kind=openai_http,target={base},model={model}",
         "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=6",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
         "--tokenizer", f"kind=hf_auto,model={smollm2_tokenizer_dir}",
         "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, **OFFLINE})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]  # exit 0 says nothing: read the report
    assert metrics["request_totals"] == {"successful": 6, "errored": 0, "incomplete": 0, "total": 6}
    output = metrics["output_token_count"]["successful"]
    assert output["count"] == 6 and 0 < output["mean"] <= 16
    assert metrics["request_streaming_iterations_count"]["successful"]["mean"] > 2  # streamed, token by token
    ttft = metrics["time_to_first_token_ms"]["successful"]
    assert ttft["count"] == 6 and 0 < ttft["min"] <= ttft["max"] < 60_000
    assert 0 < metrics["output_tokens_per_second"]["successful"]["mean"] < 10_000
    assert 0 < metrics["inter_token_latency_ms"]["successful"]["mean"] < 10_000


def _python_312() -> str | None:
    """The first Python >= 3.12 on this machine that can make a venv (PATH, then pyenv's)."""
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates = [shutil.which(f"python3.{minor}") for minor in (12, 13, 14)]
    candidates += sorted(glob.glob(f"{pyenv}/versions/3.1[2-9]*/bin/python3"))
    for candidate in filter(None, candidates):
        check = subprocess.run([candidate, "-c", "import sys, venv, ensurepip; assert sys.version_info >= (3, 12)"],
                               capture_output=True)
        if check.returncode == 0:
            return candidate
    return None


def _inference_perf() -> Path:
    """inference-perf's command, installed once into its own venv (it needs Python >= 3.12)."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loraplex-tests"
    venv = home / INFERENCE_PERF.replace("==", "-")
    command = venv / "bin" / "inference-perf"
    if (venv / ".installed").exists():
        return command
    python = _python_312()
    if python is None:
        pytest.skip("inference-perf needs Python >= 3.12 and none is installed here (PATH, pyenv)")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", INFERENCE_PERF],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    (venv / ".installed").write_text(INFERENCE_PERF)
    return command


def test_inference_perf_constant_rate_benchmark_completes_with_sane_figures(server, smollm2_tokenizer_dir: Path,
                                                                            tmp_path: Path) -> None:
    command = _inference_perf()
    base, model = server
    reports = tmp_path / "reports"
    config = {
        "load": {"type": "constant", "stages": [{"rate": 1, "duration": 8}], "num_workers": 1},
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": model, "base_url": base, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(smollm2_tokenizer_dir)},
        "data": {"type": "random", "input_distribution": {"min": 16, "max": 32, "mean": 24, "std_dev": 4},
                 "output_distribution": {"min": 8, "max": 16, "mean": 12, "std_dev": 2}},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False, "per_request": False}},
        "storage": {"local_storage": {"path": str(reports)}},
    }
    (tmp_path / "config.yml").write_text(json.dumps(config))  # YAML is a superset of JSON
    run = subprocess.run([str(command), "-c", str(tmp_path / "config.yml")], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**os.environ, **OFFLINE})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((reports / "summary_lifecycle_metrics.json").read_text())
    ok = summary["successes"]
    assert summary["failures"]["count"] == 0 and 6 <= ok["count"] <= 10  # 1 request/s for 8 s
    assert 8 <= ok["output_tokens"]["min"] <= ok["output_tokens"]["max"] <= 16  # ignore_eos: every token asked for
    # (its token_count_mismatches compares the usage with its own count of the text re-tokenized, which
    # can merge a generated token pair differently: not a count of the server's)
    ttft = ok["latency"]["time_to_first_token"]
    assert 0 < ttft["min"] <= ttft["max"] < 60
    assert 0 < ok["throughput"]["output_tokens_per_sec"] < 10_000 and 0 < ok["throughput"]["requests_per_sec"] <= 2
