"""The repository speaks to its users: README, docs (the raw records under docs/runs aside) and the
package's code and comments say what the software does and what was measured, never how the work
on it was organised (call or request numbers, issue or item numbers, sessions, machines lent or
asked for, paths of a development machine). And every relative link of README and docs resolves."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(
    r"\b[Ii]ssues? #?\d+|\b[Ii]tems? \d+\b|\b[Cc]alls? \d+\b|\bcall #\d|\b[Ss]essions?\b|\blend(?:ing|s)?\b"
    r"|\blent\b|\b\w+(?:st|nd|rd|th) (?:such )?request\b|\bdevice time\b|\bthe lead\b|\.\./shared\b"
    r"|\basked (?:as|for) (?:an? )?(?:H100|H200)")


def _user_files() -> list[Path]:
    docs = [p for p in (ROOT / "docs").rglob("*.md") if "runs" not in p.relative_to(ROOT / "docs").parts]
    return [ROOT / "README.md", *docs, *(ROOT / "megatron_hetero").rglob("*.py")]


def test_no_work_history():
    hits = [f"{path.relative_to(ROOT)}:{n}: {match.group(0)!r}"
            for path in _user_files()
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for match in HISTORY.finditer(line)]
    assert not hits, "work history in user-facing text (say what was measured instead):\n" + "\n".join(hits)


@pytest.mark.parametrize("text, found", [
    ("as in call 24", True), ("issue 49's table", True), ("this session", True), ("the fourteenth request", True),
    ("from ../shared/megatron-lm", True), ("no device time left", True),
    ("the pipeline calls the boundary", False), ("megatron's dataset helpers", False)])
def test_history_pattern(text, found):
    """The pattern finds the phrases it is for and leaves ordinary prose alone."""
    assert bool(HISTORY.search(text)) == found


LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_resolve():
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs").glob("*/*.md")]
    broken = [f"{path.relative_to(ROOT)}: {target}" for path in files
              for target in LINK.findall(path.read_text(encoding="utf-8"))
              if "://" not in target and not (path.parent / target).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
