"""Markdown tables of a bench_add_lora.py --out JSON (for benchmarks/RESULTS.md).

    python3 -m benchmarks.kernels.add_lora_md bench.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _f(v) -> str:
    return "" if v is None else f"{v:.1f}"


def decode_table(rows: list[dict], title: str) -> list[str]:
    out = [f"#### {title}", "",
           "| h_in x h_out | rank | batch | workload | SGMV us | BGMV us | Loop us | Gather-BMM us | roofline us "
           "| Gather / SGMV | Loop / SGMV |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["sgmv_us"]
        g, lp = r.get("gather_us"), r.get("loop_us")
        out.append(f"| {r['h_in']}x{r['h_out']} | {r['rank']} | {r['batch']} | {r['workload']} | {_f(s)} | "
                   f"{_f(r.get('bgmv_us'))} | {_f(lp)} | {_f(g)} | {r['roofline_us']:.1f} | "
                   f"{'' if g is None else f'{g / s:.1f}x'} | {'' if lp is None else f'{lp / s:.1f}x'} |")
    return out + [""]


def prefill_table(rows: list[dict]) -> list[str]:
    out = ["#### Prefill (T = 4096 rows, segments of L rows, one adapter each)", "",
           "| h_in x h_out | rank | L | SGMV us | Loop us | roofline us | binds | SGMV % of roofline |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        binds = "HBM" if r["bytes"] / 4.23e12 >= r["flops"] / 790e12 else "tensor"
        out.append(f"| {r['h_in']}x{r['h_out']} | {r['rank']} | {r['workload'][7:]} | {_f(r['sgmv_us'])} | "
                   f"{_f(r.get('loop_us'))} | {r['roofline_us']:.1f} | {binds} | "
                   f"{100 * r['roofline_us'] / r['sgmv_us']:.0f}% |")
    return out + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="what bench_add_lora --out wrote")
    data = json.loads(parser.parse_args().json.read_text())
    res = data["results"]
    pre = [r for r in res if r["workload"].startswith("prefill")]
    dec = [r for r in res if not r["workload"].startswith("prefill")]
    main_rows = [r for r in dec if (r["h_in"], r["h_out"], r["rank"]) == (4096, 4096, 16)]
    ranks = [r for r in dec if (r["h_in"], r["h_out"]) == (4096, 4096) and r["rank"] != 16]
    mlp = [r for r in dec if (r["h_in"], r["h_out"]) != (4096, 4096)]
    print(f"Measured copy bandwidth in this run: {data['copy_bps'] / 1e12:.2f} TB/s (torch copy_ of 1 GiB).\n")
    lines = decode_table(main_rows, "Decode, h = 4096, rank 16, the four workloads")
    lines += decode_table(ranks, "Decode, h = 4096, ranks 8 / 32 / 64")
    lines += decode_table(mlp, "Decode, 7B MLP widths (Distinct)")
    lines += prefill_table(pre)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
