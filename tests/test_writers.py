"""Our per-module metrics reach Megatron's writers: with `--tensorboard-dir` the TensorBoard event
file holds each module's waiting share, boundary bytes and (with `--timing-log-level 2`) phase
seconds per logged iteration beside Megatron's own scalars (read back with TensorBoard's reader);
with `--wandb-project` in W&B's offline mode the run's history holds them too. With
`--metrics-file` each rank's timeline of every step is written beside it: its spans add up to the
phase seconds the writers got, the LLM's first wait ends after the encoder's first forward (the
ranks' clocks line up), and `megatron-hetero timeline` draws it. One training run of
examples/pretrain_vlm.py, vision on rank 0 and the LLM on rank 1 (non-colocated: the LLM waits for
the encoder's rows, the encoder for their gradients; every row crosses between the ranks)."""

import json
import os
import runpy
import sys
from pathlib import Path

import pytest

from megatron_hetero.spec.sizes import ModelSizes
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
ITERS, GLOBAL_BATCH = 4, 4


def _train_with_writers(rank, world_size, out):
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    sys.argv = [str(ROOT / "examples" / "pretrain_vlm.py"),
                "--hetero-layout", str(ROOT / "examples" / "layouts" / "gpu2_non_colocated.yaml"),
                "--train-iters", str(ITERS), "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", "2",
                "--timing-log-level", "2",
                "--lr", "1e-3", "--seed", "7", "--log-interval", "1", "--tensorboard-dir", f"{out}/tb",
                "--tensorboard-log-interval", "1", "--wandb-project", "hetero-test", "--wandb-exp-name", "writers",
                "--wandb-save-dir", f"{out}/wandb", "--metrics-file", f"{out}/metrics.jsonl"]
    runpy.run_path(sys.argv[0], run_name="__main__")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    out = tmp_path_factory.mktemp("writers")
    run_distributed(_train_with_writers, 2, str(out))
    return out


def test_tensorboard_holds_the_module_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "lm loss" in tags, tags  # Megatron's own
    for module in ("vision", "llm"):
        shares = events.Scalars(f"hetero/waiting-share/{module}")
        assert [s.step for s in shares] == list(range(1, ITERS + 1))
        assert all(0 <= s.value <= 1 for s in shares), shares
    # Rank 0 (vision) waits for the LLM's gradients, rank 1 (the LLM) for the rows: both wait some.
    assert all(s.value > 0 for s in events.Scalars("hetero/waiting-share/max"))
    # Per step every image's rows (fp32, the LLM's width) go to the other rank, their gradients back.
    sizes = ModelSizes()
    step_bytes = GLOBAL_BATCH * sizes.patches_per_image * sizes.hidden_size * 4
    for tag in ("vision/sent", "vision/received", "llm/sent", "llm/received"):
        assert [s.value for s in events.Scalars(f"hetero/boundary-bytes/{tag}")] == [step_bytes] * ITERS, tag
    for phase in ("encoder-forward", "encoder-backward", "llm-forward", "llm-backward"):
        seconds = events.Scalars(f"hetero/phase-s/{phase}")
        assert len(seconds) == ITERS and all(s.value > 0 for s in seconds), phase


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B run file (its transaction log: a 7-byte ':W&B' header, then LevelDB's log
    format, 32 KiB blocks of records each with a 7-byte header: checksum, length, full/first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, partial, block = [], b"", 32768
    position = 7
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        payload, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == 0:
            break
        partial += payload
        if kind in (1, 4):  # full, or the last part
            records.append(partial)
            partial = b""
    return records


def test_wandb_offline_run_holds_the_module_scalars(run):
    from wandb.proto import wandb_internal_pb2

    [record_file] = (run / "wandb").rglob("offline-run-*/run-*.wandb")
    logged = []
    for data in _wandb_records(record_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            logged.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    steps = [h for h in logged if "hetero/waiting-share/llm" in h]
    assert len(steps) == ITERS and all(0 <= float(h["hetero/waiting-share/vision"]) <= 1 for h in steps), logged


def _timelines(run) -> list[dict]:
    """Per rank (0, 1): step -> its timeline record."""
    lines = [(run / f"metrics.jsonl.timeline.rank{r}.jsonl").read_text().splitlines() for r in range(2)]
    return [{record["step"]: record for record in map(json.loads, rank)} for rank in lines]


def test_timeline_matches_the_phase_seconds_and_is_drawn(run, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_hetero.cli.main import main

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    ranks = _timelines(run)
    assert [sorted(steps) for steps in ranks] == [list(range(1, ITERS + 1))] * 2
    for phase, rank in (("encoder-forward", 0), ("encoder-backward", 0), ("llm-forward", 1), ("llm-backward", 1)):
        for scalar in events.Scalars(f"hetero/phase-s/{phase}"):
            spans = [s for s in ranks[rank][scalar.step]["spans"] if s[0] == phase]
            assert sum(end - start for _, _, start, end in spans) == pytest.approx(scalar.value, rel=1e-5), phase
    for step in range(1, ITERS + 1):
        for steps in ranks:  # a rank's phases follow one another
            phases = sorted((s for s in steps[step]["spans"] if s[0] != "waiting"), key=lambda s: s[2])
            assert all(a[3] <= b[2] for a, b in zip(phases, phases[1:])), phases
        first_forward = next(s for s in ranks[0][step]["spans"] if s[0] == "encoder-forward")
        first_wait = next(s for s in ranks[1][step]["spans"] if s[0] == "waiting")
        assert first_wait[3] >= first_forward[3], (first_wait, first_forward)
    png = run / "timeline.png"
    assert main(["timeline", str(run / "metrics.jsonl"), "--step", "2", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["timeline", str(run / "none.jsonl"), "--png", str(png)]) == 2
    assert "train with --timing-log-level 2 and --metrics-file" in capsys.readouterr().err
