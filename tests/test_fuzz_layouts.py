"""The layout fuzzer, hypothesis drawing the random cases, derandomized (benchmarks/fuzz.py;
benchmarks/fuzz_layouts.py runs it for longer): random placements, 1-3 encoders, sizes, rank ranges,
frozen flags, world sizes 1-12, images per sample (0 included), tokens per image and batch sizes.
Every case is valid, or one `error:` line and exit 2 from tools/verify_layout.py, never a traceback;
valid ones are bit-exact on gloo through the real CLI; one that the example script trains reproduces
the 1-process run."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fuzz import dry_run, one_error_line, random_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hetero.spec.layout import load_layout
from megatron_hetero.training.args import ArgsError, check_args, check_trainable, parse_script_args
from tests.distributed import run_python
from tests.test_parity import FLAGS, LAYOUTS, TWO_ENCODERS, _assert_reproduces, _run, references  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
CASES = 400
EXACT_ON_GLOO = 2  # valid cases run through the CLI on gloo (world size <= 4)

_spec = importlib.util.spec_from_file_location("verify_layout", ROOT / "tools" / "verify_layout.py")
verify_layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verify_layout)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """(case, valid) for CASES cases drawn by hypothesis (derandomized: the same cases every run; a
    failure is shrunk to a smaller case), each checked by the CLI's dry run."""
    path = tmp_path_factory.mktemp("fuzz") / "layout.yaml"
    out = []

    @settings(max_examples=CASES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.randoms(use_true_random=False))
    def check(rng):
        case = random_case(rng)
        code, stderr = dry_run(verify_layout.main, case, path)
        assert code == 0 and not stderr or one_error_line(code, stderr), f"{case}\nexit {code}: {stderr}"
        out.append((case, code == 0))

    check()
    return out


def test_every_case_is_valid_or_one_error_line(cases):
    valid = sum(ok for _, ok in cases)
    print(f"fuzz: {len(cases)} layouts tried, {valid} valid")
    assert 0.1 * len(cases) < valid < 0.9 * len(cases)  # the generator reaches both kinds


def _cli(case, tmp_path, nproc: int | None = None) -> subprocess.CompletedProcess:
    """tools/verify_layout.py in its own process(es): directly as rank 0 of WORLD_SIZE, or under torchrun."""
    (tmp_path / "layout.yaml").write_text(case.layout_text())
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc else []
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT),
               **({} if nproc else dict(WORLD_SIZE=str(case.world_size), RANK="0")))
    args = [*launch, ROOT / "tools" / "verify_layout.py", tmp_path / "layout.yaml", *case.flags, "--iters", "0"]
    if nproc:
        return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, timeout=600)
    return run_python(args, env=env)


def test_invalid_case_through_the_cli_process(cases, tmp_path):
    case = next(case for case, ok in cases if not ok)
    result = _cli(case, tmp_path)
    assert one_error_line(result.returncode, result.stderr), result.stderr


def test_valid_cases_exact_on_gloo(cases, tmp_path):
    picked = [case for case, ok in cases if ok and case.world_size <= 4][:EXACT_ON_GLOO]
    for case in picked:
        result = _cli(case, tmp_path, nproc=case.world_size)
        assert result.returncode == 0 and "all edges exact" in result.stdout, f"{case}\n{result.stderr[-3000:]}"


def _reference(layout) -> str | None:
    """The 1-process layout test_parity compares `layout` with (None: none fits)."""
    kinds = sorted(m.name for m in layout.encoders)
    frozen = any(m.freeze for m in layout.encoders)
    if kinds == ["vision"]:
        return "single_frozen" if frozen else "single"
    return "single_two_encoders" if kinds == ["audio", "vision"] and not frozen else None


def _trainable(case, path):
    """(layout file, reference, flags) if the example script trains `case`'s layout, else None."""
    if case.world_size > 4:
        return None
    path.write_text(case.layout_text())
    layout = load_layout(str(path), case.world_size)
    reference = _reference(layout)
    flags = TWO_ENCODERS if reference == "single_two_encoders" else []
    args = parse_script_args(["--hetero-layout", str(path), "--global-batch-size", "8", "--micro-batch-size",
                              "2", *FLAGS, *flags], validate=False)
    try:
        check_trainable(layout)
        check_args(args, layout)
    except ArgsError:
        return None
    return (path, reference, flags) if reference else None


def test_a_trainable_case_reproduces_one_process(cases, references, tmp_path):  # noqa: F811
    path = tmp_path / "layout.yaml"
    for case, ok in cases:
        picked = ok and _trainable(case, path)
        if picked:
            break
    else:
        pytest.fail("no trainable case among the seed's")
    layout_file, reference, flags = picked
    _assert_reproduces(_run(tmp_path / "run", layout_file, case.world_size, flags), references(reference, flags))
