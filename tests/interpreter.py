"""Our Triton kernels' test scripts on Triton's CPU interpreter: each script runs as a process of its own
(`python -m tests.<script>` from the repository), since the interpreter must be on before anything imports
Triton, and prints, last, one JSON object of its results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# a unit in the last place of each dtype (the interpreter casts fp32 to bf16 toward zero: the scripts allow
# two such units)
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}


def run_on_interpreter(script: str, timeout: int = 300) -> dict:
    """tests/<script>.py under TRITON_INTERPRET=1: its last line's JSON object (the script must exit 0)."""
    done = subprocess.run([sys.executable, "-m", f"tests.{script}"], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])  # after the import-time lines


def close(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-5) -> bool:
    """A kernel's result against the fp64 reference: within one rounding of `got`'s dtype (two units in its
    last place, for the interpreter's truncation) and fp32's reordering, `floor` absolute near zero."""
    return bool(((got.double() - want).abs() <= 2 * ULP[got.dtype] * want.abs() + floor).all())
