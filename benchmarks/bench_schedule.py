"""Colocated schedules with a pipelined LLM, compared on CPU: step time, the
waiting share and each rank's peak memory under --hetero-colocated-schedule recompute, three-phase
and bubbles, plus what the ideal timeline predicts for the same pipeline.

    python benchmarks/bench_schedule.py [--iters 40] [--out docs/runs/colocated_schedules/cpu.jsonl] [-- extra flags]

Runs examples/pretrain_vlm.py under torchrun (gloo) on 2 processes, one thread each (a bubble is an
idle core), layout colocated_vdp2_lpp2 (vision DP2 -> LLM PP2), 8 microbatches per step, an
encoder about as heavy per rank as an LLM stage. Step time: median of the iterations after the
first five (metrics file); peak memory: each rank's VmHWM (Linux /proc).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_samples import read_records, rss_mib, worker_ranks

from megatron_hetero.schedules.colocated_order import predicted_step
from megatron_hetero.spec.layout import SCHEDULE_FLAG, ColocatedSchedule

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "96",
         "--enc-num-layers", "4", "--enc-hidden-size", "256", "--image-size", "64", "--patch-size", "8",
         "--global-batch-size", "16", "--micro-batch-size", "2", "--lr", "1e-4", "--eval-samples", "0"]


def measure(schedule: str, iters: int, extra: list[str]) -> dict:
    out = Path(tempfile.mkdtemp())
    metrics, log = out / "metrics.jsonl", out / "run.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "pretrain_vlm.py"), "--hetero-layout",
               str(ROOT / "examples" / "layouts" / "colocated_vdp2_lpp2.yaml"), *MODEL, "--train-iters", str(iters),
               "--log-interval", "1", "--metrics-file", str(metrics), SCHEDULE_FLAG, schedule, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peaks: dict[int, float] = {}
    with log.open("w") as sink:  # a file, not a pipe: a full pipe would stall the run
        launcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        while launcher.poll() is None:
            for rank, pid in worker_ranks(launcher.pid).items():
                peak = rss_mib(pid, peak=True)
                if peak is not None:
                    peaks[rank] = max(peaks.get(rank, 0.0), peak)
            time.sleep(0.2)
    if launcher.returncode != 0:
        raise SystemExit(f"error: {schedule}: the run failed (log: {log}):\n{log.read_text()[-3000:]}")
    records = read_records(metrics)[5:]
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])]
    waiting = [r["waiting_share"] for r in records if r.get("waiting_share") is not None]
    return dict(schedule=schedule, iters=iters, step_s=statistics.median(steps),
                waiting_share=statistics.median(waiting) if waiting else None,
                peak_rss_mib={str(r): round(p, 1) for r, p in sorted(peaks.items())},
                final_loss=records[-1]["loss"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="flags for the script (after --)")
    args = parser.parse_args(argv)
    results = [measure(schedule, args.iters, args.extra) for schedule in ColocatedSchedule]
    base = results[0]["step_s"]
    # The ideal timeline of this pipeline (pp 2, 8 microbatches) at two encoder weights per
    # microbatch (a stage's forward = 1): what the measured gains compare with.
    predicted = {share: {s: predicted_step(s, 2, 8, share) for s in ColocatedSchedule} for share in (0.5, 1.0)}
    print(f"{'schedule':<12} {'step ms':>8} {'vs recompute':>12} {'predicted (share 0.5 / 1.0)':>28} "
          f"{'waiting':>8}  peak RSS MiB per rank")
    for r in results:
        waiting = "-" if r["waiting_share"] is None else f"{r['waiting_share']:.1%}"
        gains = " / ".join(f"{p['recompute'] / p[r['schedule']] - 1:+.1%}" for p in predicted.values())
        print(f"{r['schedule']:<12} {r['step_s'] * 1e3:>8.1f} {base / r['step_s'] - 1:>+12.1%} {gains:>28} "
              f"{waiting:>8}  {r['peak_rss_mib']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            for r in results:
                f.write(json.dumps({**r, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
