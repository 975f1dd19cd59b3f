"""examples/pretrain_vlm.py with a fault injected, for the failure tests (test-side only).

    HETERO_TEST_FAULT=nan-grad:vision:3 torchrun ... tests/fault_script.py <the script's flags>

nan-grad:MODULE:ITER  gradients of MODULE's parameters are NaN from iteration ITER on
nan-output:MODULE:ITER  MODULE's forward output is NaN from iteration ITER on
(unset)                 no fault
kill:MODULE:ITER:RANK   rank RANK SIGKILLs itself in MODULE's forward at iteration ITER, after two
                        heartbeats there (so that its last heartbeat names the phase) and after
                        writing the time to $HETERO_TEST_KILLED
hang:MODULE:ITER:RANK   the same with SIGSTOP: the rank stops, its sockets stay open (a hung rank)
oom:MODULE:ITER:RANK    rank RANK's MODULE forward raises torch's out-of-memory error at iteration ITER
"""

import os
import runpy
import signal
import time
from pathlib import Path

import torch
from megatron.training import get_args

from megatron_hetero.training import providers

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "pretrain_vlm.py"


def _from_iteration(start: int) -> bool:
    return get_args().curr_iteration + 1 >= start  # Megatron counts iterations from 1 in its logs


def _inject(parts, kind: str, module: str, start: int) -> None:
    part = parts.parts.get(module)
    if part is None:  # held on other ranks
        return
    nan = torch.tensor(float("nan"))
    if kind == "nan-grad":
        for param in part.parameters():
            param.register_hook(lambda grad: grad * nan if _from_iteration(start) else grad)
    elif kind == "nan-output":
        part.register_forward_hook(lambda _m, _i, out: out * nan if _from_iteration(start) else None)
    elif kind in ("kill", "hang"):
        part.register_forward_hook(lambda *_: _kill(kind) if _from_iteration(start) else None)
    elif kind == "oom":
        part.register_forward_hook(lambda *_: _out_of_memory() if _from_iteration(start) else None)
    else:
        raise ValueError(kind)


def _out_of_memory() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                 "79.11 GiB of which 1.06 GiB is free. Of the allocated memory 70.40 GiB is allocated "
                                 "by PyTorch, and 6.50 GiB is reserved by PyTorch but unallocated.")


def _kill(kind: str) -> None:
    time.sleep(2 * get_args().hetero_heartbeat_interval)
    Path(os.environ["HETERO_TEST_KILLED"]).write_text(str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)


def main() -> None:
    kind, module, start, *rank = os.environ.get("HETERO_TEST_FAULT", "none:-:0:-").split(":")
    if kind == "none" or rank and rank != [os.environ["RANK"]]:
        return runpy.run_path(str(SCRIPT), run_name="__main__")
    original = providers.model_provider

    def model_provider(*args, **kwargs):
        parts = original(*args, **kwargs)
        _inject(parts, kind, module, int(start))
        return parts

    providers.model_provider = model_provider
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    main()
