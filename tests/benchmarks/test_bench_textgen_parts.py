"""bench_textgen's parts: runs made back to back add up to one table (benchmarks/engine/textgen_parts.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.engine import bench_textgen, textgen_parts


def _row(workload: str, throughput: float) -> dict:
    return dict(workload=workload, throughput=throughput, decode_tps=throughput * 0.98, tpot_p50=8.0, tpot_p99=17.0,
                ttft_p50=30.0, ttft_p99=60.0, full_step_ms=8.5, roof=5.82, roof_lora=6.43)


def test_rows_from_several_runs_make_one_table_in_workload_order(tmp_path: Path) -> None:
    first, second = "python -m benchmarks.engine.bench_textgen --workloads base,distinct", "... --workloads identical"
    textgen_parts.save_row(tmp_path, _row("base", 4000.0), first)
    textgen_parts.save_row(tmp_path, _row("distinct", 3600.0), first)
    textgen_parts.save_row(tmp_path, _row("identical", 3900.0), second)
    textgen_parts.save_row(tmp_path, _row("identical", 3800.0), second)  # a rerun replaces its part
    fixed = dict(new_tokens=128, adapters=4, hf=[400.0, 150.0], loraplex={"4 adapters mixed": 2500.0})
    textgen_parts.save_fixed(tmp_path, fixed, second)
    assert not list(tmp_path.glob("*.tmp"))

    parts = textgen_parts.load(tmp_path, bench_textgen.WORKLOADS)
    assert [r["workload"] for r in parts.rows] == ["distinct", "identical", "base"]
    assert parts.commands == [first, second] and len(parts.hosts) == 1
    lines = bench_textgen.table(parts.rows, 32, parts.fixed)
    assert lines[2].startswith("| distinct | 3600 |") and "| -10.0% |" in lines[2]  # against the other run's base
    assert "| identical | 3800 |" in lines[3] and "| -5.0% |" in lines[3]
    assert "| transformers + PEFT, 4 adapters mixed (adapter_names) | 150 |" in lines
    assert "| loraplex, 4 adapters mixed | 2500 |" in lines


def test_an_empty_folder_gives_no_rows_and_no_fixed_batch(tmp_path: Path) -> None:
    parts = textgen_parts.load(tmp_path, bench_textgen.WORKLOADS)
    assert parts.rows == [] and parts.fixed is None and parts.commands == []
    assert bench_textgen.table([], 32, None)[2:] == []
