"""A lost rank ends every other rank within a bounded time, with a line naming it and its phase.

Each rank runs a heartbeat thread on the job's c10d store (the one torch.distributed started from,
MASTER_ADDR:MASTER_PORT: torchrun's agent store, or rank 0's): every `interval` seconds it writes
`count iteration phase` for its rank, and it reads two keys: its successor's heartbeat (rank + 1,
so that every rank is watched by one other, O(world) store traffic in all) and the job's `fault`.

How a rank stops, whichever comes first:
- its main thread fails in a collective (gloo reports a dead peer at once: connection reset) and
  the step's wrapper calls `fail`: the ranks whose heartbeats stand still (without an exit record)
  are the lost ones; the line names them, their last phase, and this rank's own;
- SIGTERM (torchrun ends the other workers when one dies; Slurm): the same report from the thread,
  even while the main thread is blocked in a collective;
- the successor's heartbeat stands still for `timeout` seconds (a hung or unreachable rank: no
  error reaches the collectives before their own timeout): it is reported lost;
- another rank recorded a fault, or the store is unreachable (the launcher that hosted it ended).
In each case: one `error:` line on stderr, the fault recorded for the others, then `os._exit(1)`
(a process blocked in a collective cannot unwind; nothing is left running).
"""

import atexit
import datetime
import os
import select
import signal
import sys
import threading
import time
from typing import Callable, NoReturn

import torch.distributed as dist

# Keys under the job's store; a torchrun restart starts a fresh set.
PREFIX = f"megatron_hetero/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class Watchdog:
    """Heartbeats of this rank on `store`; `status()` -> (iteration, phase) of this rank now."""

    def __init__(self, store, rank: int, world_size: int, interval: float, timeout: float,
                 status: Callable[[], tuple[int, str]], where: str = "the job's store"):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval, self.timeout, self.status, self.where = interval, timeout, status, where
        self._count = 0
        self._reporting = threading.Lock()
        self._wakeup = self._wake = None  # the pipe that wakes the thread: SIGTERM, or stop()
        self._stopped = self._sigterm = False
        self._thread = threading.Thread(target=self._run, name="megatron-hetero-watchdog", daemon=True)

    # ---- the heartbeat thread ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread and route SIGTERM to it (call from the main thread)."""
        self._beat()
        self._wakeup, self._wake = os.pipe()
        os.set_blocking(self._wake, False)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: None)  # the thread reports; see the pipe
            signal.set_wakeup_fd(self._wake, warn_on_full_buffer=False)
            self._sigterm = True
        self._thread.start()
        atexit.register(self.stop)  # before the interpreter ends its daemon threads

    def stop(self) -> None:
        """Training is over: no more heartbeats or reports (the store's host may end before this rank
        does); SIGTERM as before (call from the main thread). The thread is joined: a daemon thread
        still inside a store call when the interpreter ends aborts the process."""
        if self._stopped:
            return
        self._stopped = True
        if self._sigterm:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.write(self._wake, b"\0")
        self._thread.join(timeout=2 * self.interval + 5)

    def _beat(self) -> None:
        iteration, phase = self.status()
        self.store.set(f"{PREFIX}beat/{self.rank}", f"{self._count} {iteration} {phase}")
        self._count += 1

    def _run(self) -> None:
        successor = (self.rank + 1) % self.world_size
        last, since = None, time.monotonic()
        try:
            while True:
                sigterm = self._sleep()
                if self._stopped:
                    return
                if sigterm:
                    self.fail("stopped by SIGTERM (the launcher ends the job: another rank failed)")
                self._beat()
                fault = self._fault()
                if fault is not None:
                    self._exit(f"{self._own()}: {fault}")
                if successor == self.rank:
                    continue
                beat = self._get_beat(successor)
                now = time.monotonic()
                if beat != last:
                    last, since = beat, now
                elif now - since > self.timeout and not self._exited(successor):
                    self._report(f"rank {successor} is lost: no heartbeat for {self.timeout:.0f} s "
                                 f"(last {describe(beat)})")
        except Exception as error:  # noqa: BLE001 (any store failure means the job is gone)
            if not self._stopped:
                self._unreachable(error)

    def _sleep(self) -> bool:
        """Wait one interval (or until woken); True if SIGTERM arrived."""
        ready, _, _ = select.select([self._wakeup], [], [], self.interval)
        return bool(ready) and signal.SIGTERM in os.read(self._wakeup, 64)

    # ---- reports ----------------------------------------------------------------------------------
    def _get_beat(self, rank: int) -> str | None:
        key = f"{PREFIX}beat/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _exited(self, rank: int) -> bool:
        return self.store.check([f"{PREFIX}exit/{rank}"])

    def _fault(self) -> str | None:
        key = PREFIX + "fault"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def lost_ranks(self) -> list[str]:
        """Ranks whose heartbeat stands still over three intervals and that recorded no exit."""
        before = {r: self._get_beat(r) for r in range(self.world_size) if r != self.rank}
        time.sleep(3 * self.interval)
        return [f"rank {r} (last {describe(beat)})" for r, beat in before.items()
                if beat == self._get_beat(r) and not self._exited(r)]

    def _own(self) -> str:
        iteration, phase = self.status()
        return f"rank {self.rank} stopped in {phase} at iteration {iteration}"

    def fail(self, cause: str, unless_all_alive: bool = False) -> None:
        """This rank cannot go on (`cause`): report the lost ranks (or the fault another rank
        recorded) and exit. With `unless_all_alive`, return where no rank is lost and no fault is
        recorded (an error of this rank's own, which its caller raises)."""
        self._reporting.acquire()  # one report per process: the other thread waits for the exit
        try:
            self.store.set(f"{PREFIX}exit/{self.rank}", cause)
            lost, fault = self.lost_ranks(), self._fault()
        except Exception as error:  # noqa: BLE001 (the store is gone with the job)
            self._unreachable(error)
        if lost:
            self._report(f"lost {', '.join(lost)}; {cause}")
        if fault is not None:
            self._exit(f"{self._own()}: {fault}; here: {cause}")
        if not unless_all_alive:
            self._report(f"no rank is lost; {cause}")
        self._reporting.release()

    def report(self, message: str) -> NoReturn:
        """This rank stops the job: `message` recorded as its fault (every rank stops within an
        interval, each with one line naming it), this rank's own line, exit."""
        self._reporting.acquire()  # not while the thread reports
        try:
            self.store.compare_set(PREFIX + "fault", "", f"{message} (reported by rank {self.rank})")
        except Exception as error:  # noqa: BLE001 (the store is gone with the job)
            self._unreachable(error)
        self._exit(f"{self._own()}: {message}")

    def _report(self, message: str) -> NoReturn:
        self.store.compare_set(PREFIX + "fault", "", f"{message} (reported by rank {self.rank})")
        self._exit(f"{self._own()}: {message}")

    def _unreachable(self, error: BaseException) -> NoReturn:
        self._exit(f"{self._own()}: {self.where} is unreachable ({first_line(error)}): its host is lost")

    def _exit(self, line: str) -> NoReturn:
        try:
            self.store.set(f"{PREFIX}exit/{self.rank}", line)
        except Exception:  # noqa: BLE001 (the store may be what is gone)
            pass
        write_line(f"error: {line}")
        os._exit(1)


def write_line(line: str) -> None:
    """`line` on stderr in one write: a pipe keeps a write of up to PIPE_BUF bytes whole, so the lines
    ranks report at the same moment never interleave (print writes the newline separately when
    Python runs unbuffered, and another rank's line could land between)."""
    sys.stderr.flush()
    data = f"{line}\n".encode()
    while data:  # a longer line may be written in parts
        data = data[os.write(sys.stderr.fileno(), data):]


def describe(beat: str | None) -> str:
    """A heartbeat value as words."""
    if beat is None:
        return "heard: never"
    _, iteration, phase = beat.split(" ", 2)
    return f"heard in {phase} at iteration {iteration}"


def first_line(error: BaseException, limit: int = 200) -> str:
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[:limit - 3] + "..."


def job_store(timeout: datetime.timedelta):
    """A client of the store torch.distributed started from (env:// rendezvous), and its address."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return store, f"the job's store at {host}:{port} ({'torchrun agent' if agent else 'rank 0'}'s)"
