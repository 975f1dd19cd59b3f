"""The installed wheel is the product: built offline from this checkout, installed into a fresh
virtualenv that sees the project environment's packages (torch, megatron-core, ...) but not its
editable install, and run from a directory outside the repository as a user runs it: Megatron-LM's
pretrain_vlm.py through `python -m torch.distributed.run ... -m megatron_hetero.launch`, and
examples/pretrain_vlm.py, each colocated and non-colocated on 2 gloo processes for 2 iterations.

The four runs start together from one module-scoped build (about 25 s each alone on 2 cores,
mostly interpreter start-up: concurrently they share the cores' idle time)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.distributed import MEGATRON_LM_SCRIPT

ROOT = Path(__file__).parent.parent
TIMEOUT = 300  # seconds for all four runs
ITERATIONS = 2
# What `pip wheel .` reads from the checkout; everything else (the venv, results, caches) stays out.
NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", "out", "build", "dist", "*.egg-info", "__pycache__")
MEGATRON_LM_FLAGS = f"""--encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4
    --seq-length 64 --decoder-seq-length 96 --max-position-embeddings 128 --img-h 32 --img-w 32 --patch-dim 8
    --micro-batch-size 2 --global-batch-size 4 --train-iters {ITERATIONS} --eval-interval 1000 --eval-iters 0
    --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --make-vocab-size-divisible-by 32
    --transformer-impl local --use-cpu-initialization --num-workers 0 --log-interval 1 --seed 1234
    --ckpt-format torch""".split()
EXAMPLE_FLAGS = ["--train-iters", str(ITERATIONS), "--global-batch-size", "4", "--micro-batch-size", "2"]
LAYOUTS = {
    "colocated": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, tp: 2}\n",
    "non_colocated": "placement: non_colocated\nmodules:\n  vision: {role: encoder, ranks: 0-0}\n"
                     "  llm: {role: llm, ranks: 1-1}\n",
}
CASES = [(script, placement) for script in ("megatron_lm", "example") for placement in LAYOUTS]


def _project_site_dirs() -> list[str]:
    """The project environment's package directories (its site-packages and those its .pth files
    add), without the checkout itself."""
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))
            and Path(p).resolve() != ROOT.resolve()]


def _fresh_env(work: Path) -> Path:
    """The wheel built from a copy of the checkout, installed into a new virtualenv whose .pth names
    the project's package directories (not the editable install's finder); its python."""
    shutil.copytree(ROOT, work / "src", ignore=NOT_SOURCE)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(work / "dist"),
                    str(work / "src")], check=True, cwd=work)
    (wheel,) = (work / "dist").glob("megatron_hetero-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(work / "venv")], check=True)
    python = work / "venv" / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", "--ignore-installed",
                    str(wheel)], check=True, cwd=work)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "project_env.pth").write_text("\n".join(_project_site_dirs()) + "\n")
    return python


def _command(python: Path, run: Path, script: str, placement: str) -> list[str]:
    layout = run / "layout.yaml"
    layout.write_text(LAYOUTS[placement])
    torchrun = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if script == "megatron_lm":
        return [*torchrun, "-m", "megatron_hetero.launch", str(MEGATRON_LM_SCRIPT), *MEGATRON_LM_FLAGS,
                "--hetero-layout", str(layout)]
    return [*torchrun, str(ROOT / "examples" / "pretrain_vlm.py"), *EXAMPLE_FLAGS, "--hetero-layout", str(layout)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The fresh environment's python, and every case's run started in a directory of its own."""
    work = tmp_path_factory.mktemp("wheel")
    python = _fresh_env(work)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    runs = {}
    for script, placement in CASES:
        if script == "megatron_lm" and not MEGATRON_LM_SCRIPT.is_file():
            continue
        run = work / f"{script}_{placement}"
        run.mkdir()
        with open(run / "log", "w") as log:
            runs[script, placement] = run, subprocess.Popen(
                _command(python, run, script, placement), cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
    yield python, env, runs
    for _, proc in runs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_installed_package_is_the_wheels(installed):
    """Outside the checkout the fresh environment imports megatron_hetero, its patches and every
    subpackage from the wheel; the repository's tests/ and tools/ are no subpackages of it."""
    python, env, _ = installed
    code = ("import importlib, importlib.util, pkgutil, megatron_hetero as m\n"
            "names = [n for _, n, _ in pkgutil.walk_packages(m.__path__, 'megatron_hetero.')\n"
            "         if not n.endswith('__main__')]\n"
            "files = [importlib.import_module(n).__file__ for n in names]\n"
            "homes = sorted(set(f.split('/megatron_hetero/')[0] for f in files))\n"
            "print(m.__file__); print(len(names)); print(*homes)\n"
            "spec = importlib.util.find_spec\n"
            "print(spec('megatron_hetero.tests'), spec('megatron_hetero.tools'))\n")
    out = subprocess.run([python, "-c", code], cwd=python.parent, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    init, count, homes, specs = out.stdout.splitlines()[-4:]
    site = sysconfig.get_path("purelib", vars={"base": str(python.parent.parent)})
    assert init.startswith(site), init
    assert homes == site and int(count) > 60, (homes, count)  # every module, patches among them
    assert specs == "None None"


def test_wheel_installs_the_command(installed):
    """The wheel puts `megatron-hetero` beside the environment's python, and it runs."""
    python, env, _ = installed
    out = subprocess.run([python.parent / "megatron-hetero", "--version"], cwd=python.parent, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0 and out.stdout.startswith("megatron-hetero "), out.stderr[-3000:]


@pytest.mark.parametrize("script, placement", CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_wheel_trains_from_outside_the_checkout(installed, script, placement):
    """Two iterations, every rank exiting 0, Megatron's iteration lines with a finite lm loss."""
    if script == "megatron_lm" and not MEGATRON_LM_SCRIPT.is_file():
        pytest.skip(f"Megatron-LM's scripts not found ({MEGATRON_LM_SCRIPT}): put a Megatron-LM checkout "
                    f"(branch core_r0.19.0) beside the repository (shared/megatron-lm) or name one in MEGATRON_LM_DIR")
    _, _, runs = installed
    run, proc = runs[script, placement]
    try:
        code = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        code = f"timeout after {TIMEOUT} s"
    log = (run / "log").read_text(errors="replace")
    assert code == 0, f"{code}\n{log[-4000:]}"
    losses = re.findall(rf"iteration\s+(\d+)/\s*{ITERATIONS} \|.* lm loss: (\S+) \|", log)
    assert [int(i) for i, _ in losses] == list(range(1, ITERATIONS + 1)), log[-4000:]
    assert all(float(loss) == float(loss) for _, loss in losses), losses  # not NaN
    assert "Traceback" not in log, log[-4000:]
