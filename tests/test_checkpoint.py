"""Checkpoints through Megatron's --save/--load (torch_dist) of examples/pretrain_vlm.py.

Resume: 10 iterations straight equal 5 + save + resume for 5, to the last bit (fp32, CPU).
Reshard: a checkpoint saved under layout A at iteration 5 and loaded under layout B continues as
the uninterrupted run under A does (loss and gradient norm per step within 1e-5 relative), for each
pair the issue names; the reference of each pair is that uninterrupted run (one run of A serves
several pairs: saving does not change its trajectory).
"""

import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import _free_port, run_distributed, run_python

SCRIPT = Path(__file__).parent.parent / "examples" / "pretrain_vlm.py"
LAYOUTS = Path(__file__).parent.parent / "examples" / "layouts"
FLAGS = ["--train-iters", "10", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "1e-3",
         "--seed", "7", "--log-interval", "100", "--save-interval", "5"]
RTOL = 1e-5

# Layouts of the pairs, beside examples/layouts' (world size 4 unless the name says).
EXTRA_LAYOUTS = {
    "vtp2dp2_ltp2dp2": "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 2, dp: 2}\n"
                       "  llm: {role: llm, tp: 2, dp: 2}\nedges: [vision -> llm]\n",
    "vdp4_ltp1dp4": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4}\n"
                    "  llm: {role: llm, dp: 4}\nedges: [vision -> llm]\n",
    "vdp4_lpp2dp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4}\n"
                    "  llm: {role: llm, pp: 2, dp: 2}\nedges: [vision -> llm]\n",
    "vdp4_lcp2dp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4}\n"
                    "  llm: {role: llm, cp: 2, dp: 2}\nedges: [vision -> llm]\n",
    "w2_vdp2_ltp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n"
                    "  llm: {role: llm, tp: 2}\nedges: [vision -> llm]\n",
    "w6_vdp2_ltp2dp2": "placement: non_colocated\nmodules:\n  vision: {role: encoder, dp: 2, ranks: 0-1}\n"
                       "  llm: {role: llm, tp: 2, dp: 2, ranks: 2-5}\n",
}


def _train(rank, world_size, argv):
    sys.argv = [str(SCRIPT), *argv]
    runpy.run_path(str(SCRIPT), run_name="__main__")


def _layout(name: str, tmp: Path) -> Path:
    if name in EXTRA_LAYOUTS:
        path = tmp / f"{name}.yaml"
        path.write_text(EXTRA_LAYOUTS[name])
        return path
    return LAYOUTS / f"{name}.yaml"


def run(tmp: Path, tag: str, layout: str, world: int, flags=()) -> dict[int, dict]:
    """examples/pretrain_vlm.py under `layout` (a name in EXTRA_LAYOUTS or examples/layouts) on
    `world` processes (FLAGS, then `flags`); its metrics per step."""
    out = tmp / tag
    out.mkdir()
    run_distributed(_train, world, ["--hetero-layout", str(_layout(layout, tmp)),
                                    "--metrics-file", str(out / "metrics.jsonl"), *FLAGS, *flags])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def assert_continues(reference: dict, resumed: dict, first: int = 6, exact: bool = False):
    assert sorted(resumed) == list(range(first, 11)), sorted(resumed)
    for step in resumed:
        for key in ("loss", "grad_norm"):
            want, got = reference[step][key], resumed[step][key]
            if exact:
                assert got == want, (step, key, got, want)
            else:
                assert got == pytest.approx(want, rel=RTOL), (step, key, got, want)


class Saved:
    """An uninterrupted 10-step run that saved at 5 and 10: its metrics and checkpoint directory."""

    def __init__(self, tmp: Path, tag: str, layout: str, world: int, flags=()):
        self.dir = tmp / f"{tag}_ckpt"
        self.metrics = run(tmp, tag, layout, world, ["--save", str(self.dir), *flags])
        self.tmp = tmp

    def resume(self, tag: str, layout: str, world: int, flags=(), iteration: int = 5) -> dict:
        return run(self.tmp, tag, layout, world, ["--load", str(at(self.dir, iteration, tag)), *flags])


def at(directory: Path, iteration: int, tag: str) -> Path:
    """A copy of a checkpoint directory whose tracker names `iteration`."""
    copy = directory.parent / f"{directory.name}_{tag}_at{iteration}"
    shutil.copytree(directory, copy)
    (copy / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return copy


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def colocated(tmp):  # vision TP1/DP4 -> LLM TP2/DP2
    return Saved(tmp, "colocated", "demo_colocated", 4)


@pytest.fixture(scope="module")
def non_colocated(tmp):  # vision DP2 on ranks 0-1 -> LLM TP2 on ranks 2-3
    return Saved(tmp, "non_colocated", "non_colocated_2_2", 4)


def test_resume_is_bit_identical(colocated):
    assert_continues(colocated.metrics, colocated.resume("resume", "demo_colocated", 4), exact=True)


def test_resume_non_colocated_is_bit_identical(non_colocated):
    assert_continues(non_colocated.metrics, non_colocated.resume("resume_nc", "non_colocated_2_2", 4), exact=True)


# Layout B of each pair whose A is `colocated` (vision TP1/DP4 -> LLM TP2/DP2), by what changes.
FROM_COLOCATED = {
    "encoder_tp_dp": "vtp2dp2_ltp2dp2",
    "llm_tp": "vdp4_ltp1dp4",
    "llm_pp": "vdp4_lpp2dp2",
    "llm_cp": "vdp4_lcp2dp2",
    "colocated_to_non_colocated": "non_colocated_2_2",
}


@pytest.mark.parametrize("change", FROM_COLOCATED)
def test_reshard_from_colocated(colocated, change):
    assert_continues(colocated.metrics, colocated.resume(change, FROM_COLOCATED[change], 4))


def test_reshard_non_colocated_to_colocated(non_colocated):
    assert_continues(non_colocated.metrics, non_colocated.resume("to_co", "demo_colocated", 4))


def test_reshard_vocabulary_padding(tmp):
    """Saved by one process (the vocabulary padded to 128 rows), loaded under LLM TP3 (padded to 384:
    the load zero-fills the rows the checkpoint lacks, which are not the model's)."""
    sizes = ["--hidden-size", "48", "--num-attention-heads", "6"]
    saved = Saved(tmp, "vocab_tp1", "single", 1, sizes)
    assert_continues(saved.metrics, saved.resume("vocab_tp3", "colocated_vdp3_ltp3", 3, sizes))


def test_reshard_world_4_to_2_to_6(colocated, tmp):
    """4 processes save at 5; 2 processes load it and save at 8; 6 processes load that."""
    two = colocated.resume("w2", "w2_vdp2_ltp2", 2, ["--save", str(tmp / "w2_ckpt"), "--save-interval", "4"])
    assert_continues(colocated.metrics, two)
    six = run(tmp, "w6", "w6_vdp2_ltp2dp2", 6, ["--load", str(at(tmp / "w2_ckpt", 8, "w6"))])
    assert sorted(six) == [9, 10], sorted(six)
    for step in six:
        assert six[step]["loss"] == pytest.approx(colocated.metrics[step]["loss"], rel=RTOL)
        assert six[step]["grad_norm"] == pytest.approx(colocated.metrics[step]["grad_norm"], rel=RTOL)


@pytest.fixture(scope="module")
def distributed_optimizer(tmp):  # vision TP1/DP4 -> LLM TP2/DP2, each DP rank holding its optimizer shard
    return Saved(tmp, "distopt", "demo_colocated", 4, ["--use-distributed-optimizer"])


def test_resume_distributed_optimizer_is_bit_identical(distributed_optimizer):
    resumed = distributed_optimizer.resume("distopt_on", "demo_colocated", 4, ["--use-distributed-optimizer"])
    assert_continues(distributed_optimizer.metrics, resumed, exact=True)


def test_reshard_distributed_optimizer_off_and_dp(distributed_optimizer):
    """Saved with --use-distributed-optimizer (LLM DP2, vision DP4), loaded without it at LLM DP4."""
    assert_continues(distributed_optimizer.metrics, distributed_optimizer.resume("distopt_off", "vdp4_ltp1dp4", 4))


def test_frozen_encoder_into_trainable(tmp):
    """A checkpoint of a frozen-encoder run loaded with the encoder trained: the encoder's weights come
    from the checkpoint and its optimizer starts anew; the continuation equals one process doing the
    same (the single layout, loading the same checkpoint)."""
    saved = Saved(tmp, "frozen", "demo_colocated_frozen", 4)
    four = saved.resume("unfrozen4", "demo_colocated", 4)
    one = saved.resume("unfrozen1", "single", 1)
    assert_continues(one, four)
    assert four[6]["grad_norm"] != pytest.approx(saved.metrics[6]["grad_norm"], rel=1e-3)  # the encoder trains


def _one_process(argv, cwd: Path) -> subprocess.CompletedProcess:
    """The script in one plain process (no torchrun: its own exit code and stderr)."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), PYTHONWARNINGS="ignore")
    return run_python([SCRIPT, "--hetero-layout", LAYOUTS / "single.yaml", *FLAGS, *argv], env=env, cwd=cwd,
                      timeout=300)


def _damaged(colocated, tag: str, damage) -> Path:
    directory = at(colocated.dir, 5, tag)
    damage(directory / "iter_0000005")
    return directory


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("tag, damage, flags, expected", [
    ("missing_shard", lambda d: (d / "__1_0.distcp").unlink(), [], "shard file __1_0.distcp is missing"),
    ("truncated", lambda d: _truncate(d / "__2_0.distcp"), [], "shard file __2_0.distcp is truncated"),
    ("sizes", lambda d: None, ["--hidden-size", "128"], "in this run's model (model sizes differ"),
    ("no_metadata", lambda d: (d / ".metadata").unlink(), [], "cannot be read"),
], ids=["missing_shard", "truncated", "sizes", "no_metadata"])
def test_damaged_checkpoint_is_one_line(colocated, tmp, tag, damage, flags, expected):
    directory = _damaged(colocated, tag, damage)
    result = _one_process(["--load", str(directory), *flags], tmp)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and expected in errors[0], errors
    assert f"checkpoint {directory / 'iter_0000005'}: " in errors[0], errors
    assert "module " in errors[0] or tag == "no_metadata"
    assert "Traceback" not in result.stderr


def _train_killed_mid_save(rank, world_size, argv, kill_rank, kill_iteration):
    """The script, with rank `kill_rank` SIGKILLed right after writing its part of the save at
    `kill_iteration` (the other ranks are still saving or waiting for it)."""
    from megatron.core import dist_checkpointing

    save = dist_checkpointing.save

    def save_then_die(state_dict, checkpoint_dir, *args, **kwargs):
        result = save(state_dict, checkpoint_dir, *args, **kwargs)
        if rank == kill_rank and str(checkpoint_dir).endswith(f"iter_{kill_iteration:07d}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dist_checkpointing.save = save_then_die
    _train(rank, world_size, argv)


def test_rank_killed_mid_save_keeps_previous_checkpoint(colocated, tmp):
    directory = tmp / "killed_ckpt"
    argv = ["--hetero-layout", str(LAYOUTS / "demo_colocated.yaml"), *FLAGS, "--save", str(directory)]
    with pytest.raises(Exception):  # torch.multiprocessing: a process was killed
        run_distributed(_train_killed_mid_save, 4, argv, 1, 10)
    assert (directory / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert not (directory / "iter_0000010").exists()
    resumed = run(tmp, "after_kill", "demo_colocated", 4, ["--load", str(directory), "--save", str(directory)])
    assert_continues(colocated.metrics, resumed, exact=True)
    assert (directory / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert not (directory / ".staging" / "iter_0000010").exists()  # the killed save's leftovers are gone
