"""The repository speaks to its users: README, docs and the write-ups of docs/runs, the benchmarks,
examples, tools and the package's code and comments, and the names of tracked files, say what the
software does and what was measured, never how the work on it was organised (call or request
numbers, issue or item numbers, sessions, machines lent or asked for, paths of a development
machine). The raw records under docs/runs (logs, JSON lines, outputs) are data and are not read.
And every relative link of README and docs resolves."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(
    r"\b[Ii]ssues? #?\d+|\b[Ii]tems? \d+\b|\b[Cc]alls? \d+[a-z]?\b|\bcall #\d|\b[Ss]essions?\b|\blend(?:ing|s)?\b"
    r"|\blent\b|\b\w+(?:st|nd|rd|th) (?:such )?request\b|\bdevice time\b|\bthe lead\b|\.\./shared\b"
    r"|\basked (?:as|for) (?:an? )?(?:H100|H200)|\bnvidia-h[12]00(?:-x\d)?\b|\bneeds_h200\b")
# A file or folder name spells the same words without spaces ("call15_w6", "gpu_issue27_run.sh"):
# split letters from digits and separators into spaces, then HISTORY reads it; a lettered run of a
# call ("call_a") is the one form prose cannot share.
LETTERED_CALL = re.compile(r"(?<![A-Za-z])calls?_[a-z](?![A-Za-z])")
TEXT = {"benchmarks": (".py", ".sh"), "examples": (".yaml", ".py", ".md", ".sh"), "tools": ("",),
        "megatron_hetero": (".py",)}


def _tracked() -> list[str]:
    """The tracked files' paths (git's list; without git, every file of the tree but .git's)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]


def _user_files() -> list[Path]:
    """README, docs' pages and docs/runs' write-ups (not the records in its folders), and the text
    files of the benchmarks, examples, tools and the package."""
    docs = [p for p in (ROOT / "docs").rglob("*.md")
            if "runs" not in p.relative_to(ROOT / "docs").parts or p.parent == ROOT / "docs" / "runs"]
    code = [ROOT / name for name in _tracked() if name.split("/")[0] in TEXT
            and name.endswith(TEXT[name.split("/")[0]]) and "__pycache__" not in name]
    return [ROOT / "README.md", *docs, *code]


def test_no_work_history():
    hits = [f"{path.relative_to(ROOT)}:{n}: {match.group(0)!r}"
            for path in _user_files()
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for match in HISTORY.finditer(line)]
    assert not hits, "work history in user-facing text (say what was measured instead):\n" + "\n".join(hits)


def _spelled_out(path: str) -> str:
    return re.sub(r"(?<=[A-Za-z])(?=\d)|(?<=\d)(?=[A-Za-z])|[_./-]+", " ", path)


def test_no_work_history_in_file_names():
    """A record is named by what it holds (w6_h100_pair/), a script by what it runs."""
    hits = [name for name in _tracked() if HISTORY.search(_spelled_out(name)) or LETTERED_CALL.search(name)]
    assert not hits, "work history in file names (name them by what they hold):\n" + "\n".join(hits)


@pytest.mark.parametrize("text, found", [
    ("as in call 24", True), ("issue 49's table", True), ("this session", True), ("the fourteenth request", True),
    ("from ../shared/megatron-lm", True), ("no device time left", True),
    ("the pipeline calls the boundary", False), ("megatron's dataset helpers", False),
    ("the rows of call 5a", True), ("asked as `nvidia-h100-x2`", True), ("NVIDIA H100 80GB HBM3", False)])
def test_history_pattern(text, found):
    """The pattern finds the phrases it is for and leaves ordinary prose alone."""
    assert bool(HISTORY.search(text)) == found


@pytest.mark.parametrize("name, found", [
    ("docs/runs/gpu2/call15_w6_h100/bench_e2e.log", True), ("benchmarks/gpu_issue27_run.sh", True),
    ("docs/runs/planner/check_gpu2_calls9-12.txt", True), ("docs/runs/fa4_h200/ab_quack_norm/call_a/x.md", True),
    ("docs/runs/gpu2/w6_h100_pair/bench_e2e.log", False), ("docs/runs/fa4_h200/ab_short_call/run_a/x.log", False),
    ("CHANGELOG.md", False), ("megatron_hetero/runtime/items.py", False)])
def test_file_name_pattern(name, found):
    """File names are read as prose once spelled out; record names stay clear of it."""
    assert bool(HISTORY.search(_spelled_out(name)) or LETTERED_CALL.search(name)) == found


LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_resolve():
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs").glob("*/*.md")]
    broken = [f"{path.relative_to(ROOT)}: {target}" for path in files
              for target in LINK.findall(path.read_text(encoding="utf-8"))
              if "://" not in target and not (path.parent / target).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
