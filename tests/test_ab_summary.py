"""benchmarks/ab_summary.py, the table speed changes are judged by: runs of one workload, layout, flags
and batch are one variant, its median against the workload's first variant of the same layout."""

import json
import statistics

from tests.tool_cli import run_tool


def record(layout: str, global_batch: int, tflops: float, workload: str = "W1") -> dict:
    return {"workload": workload, "llm_layers": 8, "layout": layout, "global_batch": global_batch,
            "micro_batch": 2, "tflops_per_gpu": tflops, "step_s": 1000.0 / tflops}


def test_batch_and_flags_are_variants_against_the_first(tmp_path):
    runs = [record("single", 4, 520.0), record("single", 16, 540.0), record("single_frozen", 4, 550.0),
            record("single", 4, 530.0), record("single", 16, 544.0), record("single [--x]", 4, 500.0),
            record("single", 4, 600.0, workload="W3")]
    path = tmp_path / "bench_e2e.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    result = run_tool("ab_summary", str(path), "--peak", "1000")
    assert result.returncode == 0, result.stderr
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line for line in result.stdout.splitlines()[2:]}
    assert len(rows) == 5, result.stdout
    base, large = statistics.median([520.0, 530.0]), statistics.median([540.0, 544.0])
    assert f"| 2 | {base:.1f} (520.0 / 530.0) | {base / 10:.1f}% |" in rows[("W1 L8", "single gb4/mb2")]
    assert rows[("W1 L8", "single gb4/mb2")].endswith("| +0.0% |")
    assert rows[("W1 L8", "single gb16/mb2")].endswith(f"| {100 * (large / base - 1):+.1f}% |")
    assert rows[("W1 L8", "single [--x] gb4/mb2")].endswith(f"| {100 * (500.0 / base - 1):+.1f}% |")
    # Another layout and another workload are baselines of their own.
    assert rows[("W1 L8", "single_frozen gb4/mb2")].endswith("| +0.0% |")
    assert rows[("W3 L8", "single gb4/mb2")].endswith("| +0.0% |")


def test_named_files_are_variants_the_first_the_baseline(tmp_path):
    """Two checkouts' runs with the same flags (benchmarks/gpu_batch_run.sh with BASE_REV): A=FILE B=FILE."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(record("single", 16, t)) + "\n" for t in (500.0, 510.0)))
    b.write_text("".join(json.dumps(record("single", 16, t)) + "\n" for t in (530.0, 520.0)))
    result = run_tool("ab_summary", f"A={a}", f"B={b}", "--peak", "1000")
    assert result.returncode == 0, result.stderr
    rows = result.stdout.splitlines()[2:]
    assert len(rows) == 2, result.stdout
    assert rows[0].startswith("| W1 L8 | single gb16/mb2 (A) | 2 | 505.0 (500.0 / 510.0) |")
    assert rows[0].endswith("| +0.0% |")
    assert rows[1].startswith("| W1 L8 | single gb16/mb2 (B) | 2 | 525.0 (530.0 / 520.0) |")
    assert rows[1].endswith(f"| {100 * (525.0 / 505.0 - 1):+.1f}% |")
    missing = run_tool("ab_summary", f"A={tmp_path / 'none.jsonl'}")
    assert missing.returncode == 1 and missing.stderr.strip().startswith("error: no records in"), missing.stderr


def test_each_encoders_mfu_by_itself_is_the_median_of_the_runs_that_measured_it(tmp_path):
    """bench_e2e's encoders_alone: an encoder's FLOPs per step over its seconds alone and the GPUs
    that ran it; runs from before it (none recorded) show "-"."""
    def alone(seconds: float, gpus: int) -> dict:
        return {**record("single", 4, 500.0, workload="qwen2_5_vl_7b"), "module_tflops": {"vision": 400.0},
                "encoders_alone": {"vision": {"seconds": seconds, "gpus": gpus}}}

    path = tmp_path / "bench_e2e.jsonl"
    runs = [alone(1.0, 1), alone(0.8, 1), alone(0.5, 2), record("single", 16, 500.0, workload="qwen2_5_vl_7b")]
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    result = run_tool("ab_summary", str(path), "--peak", "1000")
    assert result.returncode == 0, result.stderr
    gb4, gb16 = result.stdout.splitlines()[2:]
    assert gb4.endswith(f"| vision {statistics.median([40.0, 50.0, 40.0]):.1f}% | +0.0% |"), gb4
    assert gb16.endswith("| - | +0.0% |"), gb16
