"""Bring your own model (examples/byom/pretrain_sensor_gpt.py): a 1-D convolutional sensor encoder,
a kind megatron-hetero does not build, into a megatron-core GPT, through the public extension point
only (ModelParts and an Adapter). Under a colocated layout (both modules DP2) and a non-colocated one
(the encoder on rank 0, the GPT at TP2 on ranks 1-2) its losses and gradient norms per step equal one
process's."""

import json
import runpy
import sys
from pathlib import Path

import pytest

from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "byom" / "pretrain_sensor_gpt.py"
# The 16-token vocabulary padded to 16 rows at TP 1 and 2 alike (Megatron pads to a multiple of the flag x tp),
# so that both start from the same weights.
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "5", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--make-vocab-size-divisible-by", "8", "--seed", "3"]


def _train(rank, world_size, argv):
    sys.argv = [str(SCRIPT), *argv]
    runpy.run_path(str(SCRIPT), run_name="__main__")


def _run(tmp_path: Path, layout: str, world: int) -> dict:
    metrics = tmp_path / f"{layout}.jsonl"
    run_distributed(_train, world, [*FLAGS, "--hetero-layout", str(ROOT / "examples" / "byom" / f"{layout}.yaml"),
                                    "--metrics-file", str(metrics)])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("byom"), "sensor_single", 1)


@pytest.mark.parametrize("layout, world", [("sensor_vdp2_llm_dp2", 2), ("sensor_v1_llm_tp2", 3)])
def test_layouts_equal_one_process(reference, tmp_path, layout, world):
    got = _run(tmp_path, layout, world)
    assert sorted(got) == sorted(reference) == [1, 2, 3, 4, 5]
    for step in got:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(reference[step][key], rel=1e-5), (layout, step, key)
    assert reference[5]["loss"] < reference[1]["loss"]  # and it learns
