"""Run a script of tools/ or benchmarks/ as its users do: its own Python process, in the repository root."""

import os
import subprocess
from pathlib import Path

from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[1]


def run_tool(name: str, *args) -> subprocess.CompletedProcess:
    """tools/<name>.py (else benchmarks/<name>.py) with `args`; stdout and stderr captured as text."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    script = next(p for p in (ROOT / folder / f"{name}.py" for folder in ("tools", "benchmarks")) if p.exists())
    return run_python([script, *args], env=env, cwd=ROOT, timeout=600)
