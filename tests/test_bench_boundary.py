"""benchmarks/bench_boundary.py on 2 gloo processes: every method runs, upstream and ours deliver the
same rows, upstream refuses LLM CP, and main writes one row per method."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed

TOOL = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_boundary.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_boundary", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _bench_cases(rank, world_size, json_path):
    from megatron_hetero.patches import cpu

    tool = _load_tool()
    cpu.apply()
    env = tool.Env()
    payload = tool.make_payload(0.25, 64, torch.bfloat16)  # 2 samples of 1024 rows per rank
    assert (payload.samples, payload.rows_per_sample) == (2, 1024)
    all_rows = torch.cat([payload.encoder_rows(r, env.device) for r in range(world_size)])

    upstream = tool.Upstream(torch.bfloat16)
    assert upstream.colocated[tool.LLM_CP2].startswith("refused: dest CP must be 1")

    # Colocated fan-in: upstream's gathered rows are our LLM input slots (both sample-major).
    gathered, _ = tool.upstream_colocated(env, payload, upstream, tool.LLM_TP2).step()
    assert torch.equal(gathered, all_rows)
    # Ours through the all-gather (the plan makes the bench's TP2 edge one) and point to point.
    assert tool.plan_all_ranks(payload.batch(2), tool.ENCODER_DP2, tool.LLM_TP2)[rank].gather is not None
    tp_groups = tool.llm_tp_groups()
    for tp_group in (tp_groups[tool.LLM_TP2], None):
        slots, _ = tool.ours_colocated(env, payload, tool.LLM_TP2, tp_group).step()
        assert torch.equal(slots, all_rows)

    # Round trips: the LLM rank receives rank 0's rows; rank 0 gets gradients of their shape.
    rank0_rows = payload.encoder_rows(0, env.device)
    for bench in (tool.upstream_round_trip(env, payload, upstream), tool.ours_round_trip(env, payload)):
        received = bench.step()
        assert received.shape == rank0_rows.shape, bench.method
        if rank == 1:
            assert torch.equal(received, rank0_rows), bench.method

    tool.main(["--sizes-mb", "0.25", "--hidden", "64", "--iters", "1", "--warmup", "0", "--json", json_path])


def test_bench_boundary_on_gloo(tmp_path):
    json_path = str(tmp_path / "bench.json")
    run_distributed(_bench_cases, 2, json_path)
    rows = json.loads(Path(json_path).read_text())["rows"]
    by_method = {(row["method"], row["layout"]): row for row in rows}
    assert len(by_method) == len(rows) == 11
    payload_bytes = 0.25 * 2**20
    for (method, layout), row in by_method.items():
        if row["status"] == "ok":
            assert row["latency_ms"] > 0, (method, layout)
            # Every pattern here moves the payload out of and into each rank once.
            assert row["off_rank_mb"] * 1e6 == pytest.approx(2 * payload_bytes), (method, layout)
    assert by_method[("upstream colocated", "enc tp1 dp2 -> llm tp1 cp2 dp1")]["status"].startswith("refused:")
    assert by_method[("upstream colocated", "enc tp1 dp2 -> llm tp2 dp1 sp")]["status"].startswith("n/a:")
