"""The layout fuzzer for longer runs than `make test`'s (tests/test_fuzz_layouts.py, fixed seed).

    python benchmarks/fuzz_layouts.py --minutes 10 [--seed S] [--gloo-max-world 4] [--gloo-share 0.05]
        [--out fuzz_failures/]

Draws random layouts and batches (benchmarks/fuzz.py) until the time is up. Each goes through
tools/verify_layout.py's checks for every rank in this process (--dry-run): valid, or one `error:`
line and exit 2. A share of the valid ones with world size <= --gloo-max-world also runs through the
CLI on gloo, bit-exact forward and backward. Prints the counts; a case that fails either way is
written to --out (layout YAML + its flags) and the tool exits 1.
"""

import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from fuzz import dry_run, one_error_line, random_case

ROOT = Path(__file__).resolve().parents[1]


def _verify_main():
    spec = importlib.util.spec_from_file_location("verify_layout", ROOT / "tools" / "verify_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def on_gloo(case, path: Path) -> tuple[bool, str]:
    path.write_text(case.layout_text())
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(case.world_size), str(ROOT / "tools" / "verify_layout.py"), str(path), *case.flags,
                             "--iters", "0"], capture_output=True, text=True, timeout=900)
    return result.returncode == 0 and "all edges exact" in result.stdout, result.stdout + result.stderr


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    parser.add_argument("--gloo-max-world", type=int, default=4)
    parser.add_argument("--gloo-share", type=float, default=0.05,
                        help="share of the valid cases (world size <= --gloo-max-world) run on gloo")
    parser.add_argument("--out", type=Path, default=Path("fuzz_failures"))
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    print(f"seed {seed}", flush=True)
    rng, verify_main = random.Random(seed), _verify_main()
    path = Path(tempfile.mkdtemp()) / "layout.yaml"
    tried = valid = exact = 0
    failures = []
    end = time.monotonic() + 60 * args.minutes
    while time.monotonic() < end:
        case = random_case(rng)
        tried += 1
        try:
            code, stderr = dry_run(verify_main, case, path)
        except Exception:  # noqa: BLE001 (a traceback is what the fuzzer looks for)
            code, stderr = None, traceback.format_exc()
        if code == 0 and not stderr:
            valid += 1
            if case.world_size <= args.gloo_max_world and rng.random() < args.gloo_share:
                ok, output = on_gloo(case, path)
                exact += ok
                if not ok:
                    failures.append((case, output))
        elif not one_error_line(code, stderr):
            failures.append((case, f"exit {code}\n{stderr}"))
    print(f"{tried} layouts tried, {valid} valid, {exact} of them bit-exact on gloo through the CLI, "
          f"{len(failures)} failed")
    for i, (case, output) in enumerate(failures):
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"case{i}.yaml").write_text(f"# world size {case.world_size}, verify_layout flags: "
                                               f"{' '.join(case.flags)}\n{case.layout_text()}")
        (args.out / f"case{i}.log").write_text(output)
        print(f"failure {i}: {args.out / f'case{i}.yaml'}\n{output[-2000:]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
