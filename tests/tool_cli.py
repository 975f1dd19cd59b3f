"""Run a tool of tools/ as its users do: its own Python process, in the repository root."""

import os
import subprocess
from pathlib import Path

from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[1]


def run_tool(name: str, *args) -> subprocess.CompletedProcess:
    """tools/<name>.py with `args`; stdout and stderr captured as text."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return run_python([ROOT / "tools" / f"{name}.py", *args], env=env, cwd=ROOT, timeout=600)
