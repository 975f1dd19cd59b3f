"""Memory and step time of a long training run, sampled from outside (benchmarks/long_run.py).

The run writes `--metrics-file` (one JSON line per iteration, patches/metrics.py); a sampler polls
it and, each time the iteration count passes a multiple of `every`, reads the resident set size of
every worker process of the launcher (from /proc, so Linux only) and the mean step time since the
previous sample (from the records' elapsed_s).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path


def worker_ranks(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the launcher's child processes that have a RANK in their environment."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            env = dict(item.split("=", 1) for item in (entry / "environ").read_bytes().decode().split("\0")
                       if "=" in item)
        except (OSError, ValueError):
            continue  # gone meanwhile
        if "RANK" in env:
            ranks[int(env["RANK"])] = int(entry.name)
    return ranks


def rss_mib(pid: int, peak: bool = False) -> float | None:
    """Resident set size of `pid` in MiB, now or (`peak`) its highest so far (None once it has
    exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:" if peak else "VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def read_records(path: Path) -> list[dict]:
    """The metrics file's complete iteration records so far."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # the last piece may be a line being written
    return [r for r in map(json.loads, lines) if "step" in r]


@dataclass
class Sampler:
    """Samples at iterations every, 2 * every, ...: RSS per rank and the mean step time."""

    launcher_pid: int
    metrics: Path
    every: int
    samples: list = field(default_factory=list)
    _last: dict | None = None  # the record of the previous sample

    def poll(self) -> dict | None:
        """A new sample if the run passed the next multiple of `every`, else None."""
        records = read_records(self.metrics)
        due = (len(self.samples) + 1) * self.every
        if not records or records[-1]["step"] < due:
            return None
        record = next(r for r in records if r["step"] >= due)
        ranks = worker_ranks(self.launcher_pid)
        rss = {rank: rss_mib(pid) for rank, pid in sorted(ranks.items())}
        previous = self._last or records[0]
        steps = record["step"] - previous["step"]
        sample = dict(step=record["step"], step_s=(record["elapsed_s"] - previous["elapsed_s"]) / steps
                      if steps else None, loss=record["loss"], rss_mib=rss)
        self._last = record
        self.samples.append(sample)
        return sample


def growth(samples: list[dict], skip: int = 1) -> dict:
    """Per rank: RSS of the last sample minus the first after `skip` warm-up samples (MiB), and the
    same for the step time (seconds)."""
    steady = samples[skip:] if len(samples) > skip else samples
    first, last = steady[0], steady[-1]
    rss = {rank: last["rss_mib"][rank] - first["rss_mib"][rank] for rank in first["rss_mib"]
           if last["rss_mib"].get(rank) is not None and first["rss_mib"][rank] is not None}
    return dict(rss_mib=rss, step_s=(last["step_s"] or 0) - (first["step_s"] or 0),
                from_step=first["step"], to_step=last["step"])

