"""Run a tool of tools/ as its users do: its own Python process, in the repository root."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tool(name: str, *args) -> subprocess.CompletedProcess:
    """tools/<name>.py with `args`; stdout and stderr captured as text."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(ROOT / "tools" / f"{name}.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
