"""A lost rank, or one out of GPU memory, stops the job with a line per rank naming it (megatron.training
0.19 `train_step`, `setup_model_and_optimizer`).

Under `--hetero-layout` every rank starts a heartbeat watchdog once its groups exist
(runtime/watchdog.py; `--hetero-heartbeat-interval`, `--hetero-heartbeat-timeout`, by default
`--distributed-timeout-minutes`), and an error out of a training step is checked against it: if a
rank is lost (gloo reports a dead peer as a connection reset) or another rank recorded a fault, this
rank stops with one `error:` line naming the lost rank, its last phase and this rank's own;
otherwise (an error of this rank's own) it is raised as before. A rank out of GPU memory (building
the model and optimizer, or in a step) records one line naming the module and phase, its peak and
the flags that use less memory (runtime/failures.py) as the job's fault: every rank stops with one
line. The watchdog stops when `train` returns (what follows, e.g. an evaluation, runs without it).
"""

import contextlib
import datetime

import torch
from megatron.training import get_args

from megatron_hetero.patches._patch import PASS_THROUGH, replace
from megatron_hetero.runtime.failures import current_phase, out_of_memory_line
from megatron_hetero.runtime.watchdog import Watchdog, first_line, job_store, write_line


def start(args) -> None:
    """This rank's watchdog, after torch.distributed and the run's groups are up."""
    import torch.distributed as dist

    run = args.hetero_run
    timeout = args.hetero_heartbeat_timeout or 60.0 * args.distributed_timeout_minutes
    store, where = job_store(datetime.timedelta(seconds=timeout))

    def status():
        return getattr(args, "curr_iteration", -1) + 1, current_phase(run)

    run.handles.watchdog = Watchdog(store, dist.get_rank(), dist.get_world_size(), args.hetero_heartbeat_interval,
                            timeout, status, where)
    run.handles.watchdog.start()


@contextlib.contextmanager
def _out_of_memory_in_one_line():
    """Under --hetero-layout, out of GPU memory inside: this rank's line, recorded as the job's fault
    (every rank stops with one line), exit 1."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        run = get_args().hetero_run
        if run is None:
            raise
        line = out_of_memory_line(error, run, get_args())
        if run.handles.watchdog is not None:
            run.handles.watchdog.report(line)
        write_line(f"error: rank {run.rank}: {line}")
        raise SystemExit(1) from None


def _train_step(original):
    def train_step(*args, **kwargs):
        try:
            with _out_of_memory_in_one_line():
                return original(*args, **kwargs)
        except RuntimeError as error:
            run = get_args().hetero_run
            if run is not None and run.handles.watchdog is not None:
                run.handles.watchdog.fail(first_line(error), unless_all_alive=True)
            raise
    return train_step


def _setup(original):
    def setup_model_and_optimizer(*args, **kwargs):
        with _out_of_memory_in_one_line():
            return original(*args, **kwargs)
    return setup_model_and_optimizer


def _train(original):
    def train(*args, **kwargs):
        result = original(*args, **kwargs)
        run = get_args().hetero_run
        if run is not None and run.handles.watchdog is not None:
            run.handles.watchdog.stop()  # ranks end one by one from here; the store's host may be first
        return result
    return train


def apply() -> None:
    replace("megatron.training.training.train_step", _train_step, PASS_THROUGH)
    replace("megatron.training.training.train", _train, PASS_THROUGH)
    replace("megatron.training.training.setup_model_and_optimizer", _setup, PASS_THROUGH)
