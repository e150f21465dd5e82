"""Grammar libraries for structured output: what the host pays per decode step at batch 256.

Each constrained row needs, every step, the bitmask of the tokens its grammar allows next (filled
on the host by the library) and the library told the token chosen. This times both for
``--batch`` rows on SmolLM2-135M-Instruct's tokenizer (vocab 49152), with xgrammar and llguidance,
for a JSON schema (an order: nested objects, an array of objects, enums, integer bounds) and for
``json_object`` (any JSON object), one thread and every core. Rows replay the tokens of valid
documents (tokenized as the model would write them), each row at its own position, and start
again at the end. Also: one compile of the schema (what a cache miss costs a request).

    python -m benchmarks.engine.bench_grammar_mask [--batch 256] [--steps 64] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch


from benchmarks.common.results import record_results

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 0},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
        }, "required": ["name", "tier"], "additionalProperties": False},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number"},
        }, "required": ["sku", "quantity", "price"], "additionalProperties": False}, "maxItems": 8},
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "items", "gift"],
    "additionalProperties": False,
}
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]


def documents(count: int, seed: int = 0) -> list[str]:
    """Valid instances of SCHEMA (each also a json_object), written compactly with spaces as a
    model writes JSON."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        items = [{"sku": f"{rng.choice(WORDS)}-{rng.randint(100, 999)}", "quantity": rng.randint(1, 99),
                  "price": round(rng.uniform(1, 500), 2)} for _ in range(rng.randint(2, 5))]
        doc = {"order_id": 1000 + i, "customer": {"name": " ".join(rng.sample(WORDS, 2)).title(),
                                                   "tier": rng.choice(["free", "pro", "enterprise"])},
               "items": items, "gift": rng.random() < 0.5}
        out.append(json.dumps(doc))
    return out


class Rows:
    """Each row's token stream: a document's tokens then EOS, again and again, from its own offset."""

    def __init__(self, token_lists: list[list[int]], batch: int, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.tokens = [token_lists[i % len(token_lists)] for i in range(batch)]
        self.pos = [rng.randrange(len(t)) for t in self.tokens]

    def prefixes(self) -> list[list[int]]:
        return [t[:p] for t, p in zip(self.tokens, self.pos)]

    def next_tokens(self) -> list[int]:
        return [t[p] for t, p in zip(self.tokens, self.pos)]

    def advance(self) -> list[bool]:
        """Move every row on one token; True where a row starts its document again."""
        restarted = []
        for i, t in enumerate(self.tokens):
            self.pos[i] = (self.pos[i] + 1) % len(t)
            restarted.append(self.pos[i] == 0)
        return restarted


def _bench_xgrammar(hf_tok, eos: int, grammar_kind: str, token_lists, batch: int, steps: int, threads: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    start = time.perf_counter()
    if grammar_kind == "schema":
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                separators=(", ", ": "))
    else:
        compiled = compiler.compile_builtin_json_grammar()
    compile_ms = (time.perf_counter() - start) * 1e3
    rows = Rows(token_lists, batch)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    for m, prefix in zip(matchers, rows.prefixes()):
        for t in prefix:
            assert m.accept_token(t), "a document's token was refused"
    bitmask = xgr.allocate_token_bitmask(batch, info.vocab_size)
    batcher = xgr.BatchGrammarMatcher(max_threads=threads)
    fill, accept = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        batcher.batch_fill_next_token_bitmask(matchers, bitmask)
        t1 = time.perf_counter()
        ok = xgr.BatchGrammarMatcher.batch_accept_token(matchers, rows.next_tokens())
        for m, again in zip(matchers, rows.advance()):
            if again:
                m.reset()
        t2 = time.perf_counter()
        assert all(ok), "a document's token was refused"
        fill.append(t1 - t0)
        accept.append(t2 - t1)
    return compile_ms, fill, accept


def _bench_llguidance(hf_tok, eos: int, grammar_kind: str, token_lists, batch: int, steps: int, threads: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    tokenizer = llguidance.hf.from_tokenizer(hf_tok, n_vocab=len(hf_tok), eos_token=eos)
    schema = SCHEMA if grammar_kind == "schema" else {"type": "object"}
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    first = llguidance.LLMatcher(tokenizer, grammar)
    compile_ms = (time.perf_counter() - start) * 1e3
    assert not first.is_error(), first.get_error()
    rows = Rows(token_lists, batch)
    matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(batch)]
    for m, prefix in zip(matchers, rows.prefixes()):
        assert m.consume_tokens(prefix), m.get_error()
    bitmask = llt.allocate_token_bitmask(batch, tokenizer.vocab_size)
    executor = llguidance.LLExecutor(num_threads=threads)
    pairs = [(m, i) for i, m in enumerate(matchers)]
    fill, accept = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        llt.fill_next_token_bitmask_par(executor, pairs, bitmask)
        t1 = time.perf_counter()
        ok = llt.consume_token_par(executor, list(zip(matchers, rows.next_tokens())))
        for m, again in zip(matchers, rows.advance()):
            if again:
                m.reset()
        t2 = time.perf_counter()
        assert all(ok), [m.get_error() for m in matchers if m.is_error()][:1]
        fill.append(t1 - t0)
        accept.append(t2 - t1)
    return compile_ms, fill, accept


def _apply_ms(batch: int, vocab: int, repeats: int = 20) -> float:
    """The bitmask applied to float32 logits [batch, vocab] on the CPU (sampler.apply_bitmask)."""
    from loraplex.inference_server.engine.sampler import apply_bitmask

    logits = torch.randn(batch, vocab)
    words = (vocab + 31) // 32
    mask = torch.from_numpy(np.random.default_rng(0).integers(-2**31, 2**31, (batch, words), dtype=np.int64)
                            .astype(np.int32))
    apply_bitmask(logits, mask)
    start = time.perf_counter()
    for _ in range(repeats):
        apply_bitmask(logits, mask)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--results", type=Path, help="write this run's section of RESULTS.md")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from loraplex.inference_server.model.checkpoint import default_model_path

    gguf = default_model_path()
    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    eos = hf_tok.eos_token_id
    token_lists = [hf_tok.encode(d, add_special_tokens=False) + [eos] for d in documents(64)]
    cores = os.cpu_count() or 1
    table = [f"| library | grammar | mask fill, ms/step: p50, 1 / {cores} threads (p99) | accept, ms/step | "
             "compile, ms |", "| --- | --- | ---: | ---: | ---: |"]
    benches = {"xgrammar": _bench_xgrammar, "llguidance": _bench_llguidance}
    for name, bench in benches.items():
        for kind in ("schema", "json_object"):
            cells = []
            for threads in (1, cores):
                compile_ms, fill, accept = bench(hf_tok, eos, kind, token_lists, args.batch, args.steps, threads)
                fill_ms = [f * 1e3 for f in fill]
                cells.append(f"{statistics.median(fill_ms):.2f} ({float(np.percentile(fill_ms, 99)):.1f})")
            line = (f"| {name} | {kind} | {' / '.join(cells)} | {statistics.median(accept) * 1e3:.2f} | "
                    f"{compile_ms:.0f} |")
            print(line, flush=True)
            table.append(line)
    apply = _apply_ms(args.batch, len(hf_tok))
    notes = (f"Every row constrained, SmolLM2's tokenizer (vocab {len(hf_tok)}), {args.steps} steps; p99 holds "
             f"llguidance's warm-up. loraplex uses xgrammar (engine/grammar.py): the lower fill cost for schemas. "
             f"Applying the masks to float32 logits on the CPU (sampler.apply_bitmask): {apply:.1f} ms a step.")
    print(notes)
    if args.results:
        record_results(args.results, f"Grammar masks: xgrammar against llguidance, batch {args.batch}",
                       f"python -m benchmarks.engine.bench_grammar_mask --batch {args.batch} --steps {args.steps}",
                       table, notes)


if __name__ == "__main__":
    main()
