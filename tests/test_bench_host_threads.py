"""benchmarks/bench_host_threads.py times the layout of the preset's own images: 26,144 patches for the
Qwen2.5-VL-7B preset's 8 images, 10,528 for its first 6 (the counts its step records and results name)."""

import json

from tests.tool_cli import run_tool


def test_the_layouts_timed_are_the_presets(tmp_path):
    out = tmp_path / "threads.jsonl"
    result = run_tool("bench_host_threads", "--threads", "1", "--busy", "0", "--images", "6", "8", "--repeats", "2",
                      "--out", str(out))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["images"], r["patches"], r["threads"], r["busy_cores"]) for r in records] == [(6, 10528, 1, 0),
                                                                                          (8, 26144, 1, 0)]
    assert all(r["ms"] > 0 for r in records)
