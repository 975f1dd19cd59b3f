"""The README's commands work as written, so that it cannot drift from the code.

A shell block after `<!-- readme-test: run -->` runs line by line, at the tiny sizes it is written
at, on CPU, in a scratch directory that sees the repository's examples/ and tools/: `python ...`
and `megatron-hetero ...` forked off the tests' preloaded fork server, `torchrun --nproc-per-node N`
as N gloo processes. A block after `<!-- readme-test: megatron-lm -->` needs Megatron-LM's scripts
(MEGATRON_LM_DIR): its layout file must exist and its flags must parse with the script's own
argument parser under the patches (tests/test_megatron_lm.py trains it). Every layout file the
README names exists and the layout it shows loads."""

import os
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from tests.distributed import MEGATRON_LM_SCRIPT, run_distributed, run_python

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"<!-- readme-test: ([\w-]+) -->\n```bash\n(.*?)```", re.S)


def blocks(kind: str) -> list[str]:
    return [body for marker, body in BLOCK.findall(README) if marker == kind]


def commands(block: str) -> list[list[str]]:
    """The block's commands, continuation lines joined, comments dropped, words split as the shell does."""
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()
            if shlex.split(line, comments=True)]


def _as_main(rank, world_size, args, cwd):
    """`python *args` (a script, or -m and a module) in this rank's process, under the job's gloo group."""
    os.chdir(cwd)
    if args[0] == "-m":
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")


def run(words: list[str], cwd: Path, env: dict) -> None:
    words = [os.path.expandvars(w) for w in words]
    program, args = words[0], words[1:]
    if program == "torchrun":
        assert args[0] == "--nproc-per-node", f"the README's torchrun lines give --nproc-per-node first: {words}"
        run_distributed(_as_main, int(args[1]), args[2:], str(cwd))
        return
    if program == "megatron-hetero":
        program, args = "python", ["-m", "megatron_hetero.cli", *args]
    assert program == "python", f"a runnable README line starts with python, megatron-hetero or torchrun: {words}"
    result = run_python(args, env=env, cwd=cwd)
    assert result.returncode == 0, f"{shlex.join(words)}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"


@pytest.fixture
def scratch(tmp_path):
    for name in ("examples", "tools"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


@pytest.mark.parametrize("index", range(len(blocks("run"))))
def test_runnable_block(index, scratch, monkeypatch):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for words in commands(blocks("run")[index]):
        if words[0] == "export":
            name, value = words[1].split("=", 1)
            env[name] = value
            monkeypatch.setenv(name, value)
            continue
        run(words, scratch, env)


def _parse_megatron_lm(args):
    """Megatron-LM's pretrain_vlm.py's flags through its own parser, under the patches: unknown or
    malformed flags exit 2."""
    import megatron_hetero.patches

    megatron_hetero.patches.apply()
    from megatron.training.arguments import parse_args

    sys.path.insert(0, str(Path(args[0]).parent))  # its own imports (pretrain_gpt), as when it runs
    script = runpy.run_path(args[0], run_name="readme_test")
    sys.argv = list(args)
    parse_args(extra_args_provider=script["add_vlm_extra_args"])


def test_megatron_lm_block(tmp_path):
    if not MEGATRON_LM_SCRIPT.is_file():
        pytest.skip(f"Megatron-LM's scripts not found ({MEGATRON_LM_SCRIPT}): name a checkout in MEGATRON_LM_DIR")
    [block] = blocks("megatron-lm")
    [export, launch] = commands(block)
    assert export[0] == "export" and export[1].startswith("MEGATRON_LM_DIR="), export
    assert launch[:4] == ["torchrun", "--nproc-per-node", "4", "-m"] and launch[4] == "megatron_hetero.launch"
    args = [str(MEGATRON_LM_SCRIPT) if a == "$MEGATRON_LM_DIR/pretrain_vlm.py" else a for a in launch[5:]]
    layout = args[args.index("--hetero-layout") + 1]
    assert (ROOT / layout).is_file(), layout
    run_distributed(_parse_megatron_lm_rank, 1, args, str(ROOT))


def _parse_megatron_lm_rank(rank, world_size, args, cwd):
    os.chdir(cwd)
    _parse_megatron_lm(args)


def test_named_layout_files_exist(tmp_path):
    """Every layout file the README names exists and loads; the layout it shows loads at 4 ranks and
    is the one the Megatron-LM quickstart names (demo_colocated.yaml)."""
    from megatron_hetero.spec.layout import load_layout

    named = set(re.findall(r"examples/layouts/[\w.]+\.yaml", README))
    assert named and not [n for n in named if not (ROOT / n).is_file()]
    (tmp_path / "shown.yaml").write_text(re.search(r"```yaml\n(.*?)```", README, re.S)[1])
    shown, demo = load_layout(tmp_path / "shown.yaml", 4), load_layout(ROOT / "examples/layouts/demo_colocated.yaml", 4)
    assert shown.rank_map() == demo.rank_map()
