"""Memory and step time over a long CPU run of the demo (nothing should grow across steps).

    python benchmarks/long_run.py [--iters 2000] [--every 100] [--nproc 4] [--out docs/runs/long_run.jsonl]
        [-- extra flags for examples/pretrain_vlm.py]

Runs `torchrun --standalone --nproc-per-node N examples/pretrain_vlm.py @examples/demo_args.txt
--train-iters ITERS` and, every EVERY iterations, records each rank's resident set size and the mean
step time since the previous sample (one JSON line each in --out, a table on stdout, then the growth
from the first sample after warm-up to the last). Linux only (/proc).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_samples import Sampler, growth

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "runs" / "long_run.jsonl")
    parser.add_argument("extra", nargs="*", help="flags for the script (after --)")
    args = parser.parse_args(argv)
    metrics = Path(tempfile.mkdtemp()) / "metrics.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.nproc), str(ROOT / "examples" / "pretrain_vlm.py"), f"@{ROOT / 'examples' / 'demo_args.txt'}",
               "--train-iters", str(args.iters), "--log-interval", str(args.every), "--eval-samples", "0",
               "--metrics-file", str(metrics), *args.extra]
    print(" ".join(command), flush=True)
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(launcher.pid, metrics, args.every)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        while launcher.poll() is None:
            sample = sampler.poll()
            if sample is None:
                time.sleep(0.5)
                continue
            out.write(json.dumps(sample) + "\n")
            out.flush()
            rss = "  ".join(f"r{rank} {mib:7.1f}" for rank, mib in sample["rss_mib"].items() if mib is not None)
            print(f"step {sample['step']:5d}  {1e3 * sample['step_s']:7.1f} ms/step  loss {sample['loss']:.4f}  "
                  f"RSS MiB: {rss}", flush=True)
    if launcher.returncode != 0:
        print(launcher.stderr.read()[-3000:], file=sys.stderr)
        return launcher.returncode
    if sampler.samples:
        print("growth after the first sample:", json.dumps(growth(sampler.samples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
