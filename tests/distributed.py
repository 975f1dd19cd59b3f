"""Process helpers: run a function in N gloo processes on a free port (one launch per group of
cases, since process start-up is the expensive part on 2 cores), or a script as `python ARGS` would.

Processes start from a fork server that has imported torch and Megatron once (about 6 CPU seconds
per interpreter otherwise: most of a small test's time on 2 cores); each process is still a fresh
fork with its own globals, environment, working directory, exit code and stdout/stderr.
"""

import atexit
import datetime
import fcntl
import os
import runpy
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import traceback
import warnings
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Megatron-LM's own scripts (the client we serve): the checkout MEGATRON_LM_DIR names (MEGATRON_LM, its older
# name, too); by default shared/megatron-lm beside the repository's directory, where CI keeps it.
MEGATRON_LM_DIR = (os.environ.get("MEGATRON_LM_DIR") or os.environ.get("MEGATRON_LM")
                   or Path(__file__).resolve().parents[2] / "shared" / "megatron-lm")
MEGATRON_LM_SCRIPT = Path(MEGATRON_LM_DIR, "pretrain_vlm.py")

# Imported once by the fork server (set before it starts: the first launch starts it). Megatron's
# tokenizer package imports transformers (about 3 CPU seconds) when a run builds its tokenizer.
PRELOAD = ["torch", "megatron_hetero.patches", "megatron.training", "megatron.core.tokenizers.text",
           "tests.distributed"]
mp.set_forkserver_preload(PRELOAD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_a_new_interpreter() -> None:
    """Forked off the fork server, this process would start its own children (DataLoader workers)
    the fork server's way; a new interpreter's default is the platform's."""
    mp.set_start_method(None, force=True)


def _worker(rank, world_size, port, fn, args):
    _as_a_new_interpreter()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    # One compute thread per process: the processes of a test already share the cores (2 in CI).
    torch.set_num_threads(1)
    # A collective that never matches fails after the timeout instead of hanging the suite.
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """Run fn(rank, world_size, *args) in world_size processes; a failure in any fails the call."""
    # The job's store lives here, on a port it holds from the start (a port found free and bound
    # later by rank 0 can be taken in between).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(
        _worker, args=(world_size, store.port, fn, args), nprocs=world_size, start_method="forkserver"
    )


def _save_result(rank, world_size, fn, out_dir, args):
    torch.save(fn(rank, world_size, *args), Path(out_dir) / f"rank{rank}.pt")


def collect_distributed(fn, world_size: int, out_dir, *args) -> list:
    """run_distributed, returning what fn returned on each rank, in rank order (through out_dir)."""
    run_distributed(_save_result, world_size, fn, str(out_dir), args)
    return [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(world_size)]


def _python_main(args, env, cwd, out_path, err_path):
    """`python *args` in this (forked) process: its exit code, stdout and stderr to the files."""
    _as_a_new_interpreter()
    for fd, path in ((1, out_path), (2, err_path)):
        with open(path, "wb") as f:
            os.dup2(f.fileno(), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "ignore" in env.get("PYTHONWARNINGS", "").split(","):  # read at start-up by a new interpreter
        warnings.simplefilter("ignore")
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            # The fork server imported it already (a new interpreter would not have): runpy's notice.
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path.insert(0, str(Path(args[0]).resolve().parent))  # as the interpreter puts it
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:  # the interpreter's rules for the exit status
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    # At exit as an interpreter would: its exit functions, then (multiprocessing's own exit, on
    # SystemExit) the finalizers that stop helper processes it started, e.g. megatron-core's
    # checkpoint writer's Manager: skipped, they would outlive this process.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


@contextmanager
def _terminal():
    """A pseudo-terminal: (its path, a list filling with what is written to it until the block ends)."""
    master, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a window's size, as a shell's
    written = []

    def drain():
        with suppress(OSError):  # EIO once no process holds the terminal
            while data := os.read(master, 65536):
                written.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield os.ttyname(follower), written
    finally:
        os.close(follower)
        reader.join(10)
        os.close(master)


def run_python(args, env=None, cwd=None, timeout: float = 600, terminal: bool = False) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)` returns,
    from a process forked off the preloaded fork server (args: a script and its arguments, or
    "-m", a module and its arguments). terminal: stderr is a terminal, as in a user's shell (its
    text returned as stderr)."""
    args = [str(a) for a in args]
    with _terminal() if terminal else nullcontext((None, None)) as (tty, written):
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tty or Path(tmp) / "stderr")
            process = mp.get_context("forkserver").Process(
                target=_python_main, args=(args, dict(os.environ if env is None else env), str(cwd or os.getcwd()),
                                           str(out), str(err)))
            process.start()
            process.join(timeout)
            if process.exitcode is None:
                process.kill()
                process.join()
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout, out.read_text(),
                                                None if tty else err.read_text())
            stdout, stderr = out.read_text(errors="replace"), None if tty else err.read_text(errors="replace")
    stderr = b"".join(written).decode(errors="replace") if tty else stderr
    return subprocess.CompletedProcess([sys.executable, *args], process.exitcode, stdout, stderr)
