"""A layout as a picture (`megatron-hetero layout show L.yaml --world-size N --png F`): one column per
rank (GPU), one row per module; each cell is the rank's coordinates in that module, coloured by its
data-parallel index, each tensor-parallel group framed, each context-parallel group and pipeline stage
named; arrows are the boundary edges. matplotlib is optional (`pip install megatron-hetero[plot]`)."""

import sys

from megatron_hetero.spec.layout import HeteroLayout, ModuleLayout


class PictureError(ValueError):
    """A picture that cannot be drawn or written (no matplotlib, a --png path that cannot be written):
    one line."""


# What writes the files the commands read (their error lines name it).
BENCH_WRITER = "benchmarks/bench_e2e.py"
TIMELINE_WRITER = "a run with --timing-log-level 2"


def draw_layout(layout: HeteroLayout, path: str) -> None:
    plt = _pyplot()
    from matplotlib.patches import FancyArrowPatch, Rectangle

    rows = {m.name: len(layout.modules) - 1 - i for i, m in enumerate(layout.modules)}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * layout.world_size + 3), 1.3 * len(rows) + 1.2))
    colours = plt.get_cmap("tab20")
    for module in layout.modules:
        _draw_module(ax, module, rows[module.name], colours, Rectangle)
    for n, edge in enumerate(layout.edges):  # at the left margin, one arrow per edge
        x = -0.9 - 0.35 * n
        ax.add_patch(FancyArrowPatch((x, rows[edge.src] + 0.4), (x, rows[edge.dst] + 0.4), arrowstyle="-|>",
                                     mutation_scale=14, color="black", connectionstyle="arc3,rad=0.3"))
    ax.set_xlim(-1.2 - 0.35 * len(layout.edges), layout.world_size)
    ax.set_ylim(-0.2, len(rows))
    ax.set_xticks([r + 0.45 for r in range(layout.world_size)], [f"rank {r}" for r in range(layout.world_size)])
    ax.set_yticks([y + 0.4 for y in rows.values()],
                  [f"{m.name} ({m.role})\ntp{m.tp} cp{m.cp} dp{m.dp} pp{m.pp}" + (" sp" if m.sp else "")
                   + (" frozen" if m.freeze else "") for m in layout.modules])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    edges = ", ".join(str(e) for e in layout.edges)
    ax.set_title(f"{layout.placement} layout, world size {layout.world_size}; edges: {edges}\n"
                 "colour: data-parallel index; frame: tensor-parallel group")
    _save(fig, path)


def _draw_module(ax, module: ModuleLayout, y: int, colours, rectangle) -> None:
    """The module's cells on its row, its TP groups framed (a module's ranks run tp fastest, so a TP
    group is consecutive ranks)."""
    for rank in module.ranks:
        c = module.coords(rank)
        if c is None:  # an on_first_stage encoder: ranks of the LLM's later stages hold none of it
            continue
        ax.add_patch(rectangle((rank + 0.05, y + 0.05), 0.8, 0.7, facecolor=colours(c["dp"] % 20), alpha=0.6))
        ax.text(rank + 0.45, y + 0.4, f"tp{c['tp']} cp{c['cp']}\ndp{c['dp']} pp{c['pp']}", ha="center",
                va="center", fontsize=8)
        if c["tp"] == 0 and module.tp > 1:
            ax.add_patch(rectangle((rank, y), module.tp - 0.1, 0.8, fill=False, linewidth=2))


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PictureError("--png needs matplotlib: pip install 'megatron-hetero[plot]' (or matplotlib)") from None
    return plt


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as error:
        raise PictureError(f"--png {path}: cannot write it: {error.strerror or error}") from None
    finally:
        plt.close(fig)


def draw_breakdown(record: dict, path: str) -> None:
    """One bar per rank: the seconds of a timed step in each phase and waiting on other ranks (a
    bench_e2e record's `ranks`), stacked in the order a step runs them."""
    from megatron_hetero.runtime.timers import PHASES

    plt = _pyplot()
    ranks = record.get("ranks")
    if not ranks:
        raise ValueError(f"the record has no per-rank phases (`ranks`): give a record of {BENCH_WRITER}")
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.5 * len(ranks)))
    colours = plt.get_cmap("tab10")
    left = [0.0] * len(ranks)
    for n, phase in enumerate([*PHASES, "waiting"]):
        widths = [r.get("waiting_s", 0.0) if phase == "waiting" else r["phases"].get(phase, 0.0) for r in ranks]
        ax.barh(range(len(ranks)), widths, left=left, color="black" if phase == "waiting" else colours(n),
                label=phase)
        left = [a + b for a, b in zip(left, widths)]
    # The rest of the step: the rank idle outside its timed phases (a pipeline's bubble, for one).
    idle = [max(record.get("step_s", 0.0) - done, 0.0) for done in left]
    ax.barh(range(len(ranks)), idle, left=left, color="lightgrey", label="idle, outside the phases")
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']}: {r.get('stage', '')}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title(f"{record.get('workload', '')} under {record.get('layout', '')} on {record.get('gpus', '?')} "
                 f"{record.get('device', 'GPUs')}: {record.get('tokens_per_s', 0):,.0f} tokens/s")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)


def draw_timeline(steps: list[dict], path: str) -> None:
    """One row per rank: a training step's phases where they ran (bars from the phase timers' spans)
    and the waits on other ranks inside them (black), on the node's monotonic clock from the step's
    first span on any rank. `steps`: each rank's timeline record of one step."""
    from megatron_hetero.runtime.timers import PHASES

    plt = _pyplot()
    steps = sorted(steps, key=lambda r: r["rank"])
    origin = min(span[2] for record in steps for span in record["spans"])
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.5 * len(steps)))
    colours, labelled = plt.get_cmap("tab10"), set()
    for row, record in enumerate(steps):
        for phase, module, start, end in record["spans"]:
            waiting = phase == "waiting"
            label = None if phase in labelled else phase
            labelled.add(phase)
            colour = "black" if waiting else colours(PHASES.index(phase) if phase in PHASES else len(PHASES))
            ax.barh(row, end - start, left=start - origin, height=0.35 if waiting else 0.7, color=colour, label=label)
    ax.set_yticks(range(len(steps)), [f"rank {r['rank']}" for r in steps])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the step's first span (phases timed with the GPU synchronized at their ends; "
                  "white: outside the timed phases)")
    ax.set_title(f"training step {steps[0]['step']}: each rank's phases, and its waits on other ranks (black)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)


def _read_lines(path, writer: str) -> list[dict]:
    """The file's JSON lines, each an object (ValueError naming the first line that is not, and
    `writer`, what writes such files)."""
    import json

    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                raise ValueError(f"line {number} is not a JSON object; give a file {writer} wrote")
            records.append(record)
    return records


def _timeline_steps(path) -> dict[int, dict]:
    """A rank's timeline file by step (ValueError naming the file where a line is not a step's)."""
    try:
        records = _read_lines(path, TIMELINE_WRITER)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    if not all("step" in record for record in records):
        raise ValueError(f"{path}: a line has no step; give a file {TIMELINE_WRITER} wrote")
    return {record["step"]: record for record in records}


def _failed(error: Exception, source: str) -> int:
    """A command's error line: prefixed with the file it read, unless the PNG it wrote (PictureError,
    which names that file) is what failed; exit status 2."""
    where = "" if isinstance(error, PictureError) else f"{source}: "
    print(f"error: {where}{error}", file=sys.stderr)
    return 2


def timeline_main(argv: list[str] | None = None, prog: str = "megatron-hetero timeline") -> int:
    """`megatron-hetero timeline METRICS.jsonl --png F [--step N]`: a run's step per rank on a time axis."""
    import argparse
    import glob

    from megatron_hetero.runtime.timers import timeline_file

    parser = argparse.ArgumentParser(prog=prog, description="Draw a training step of a run per rank on a time "
                                     "axis: its phases and its waits on other ranks. The run needs --metrics-file "
                                     "METRICS.jsonl and --timing-log-level 2 (each rank then writes "
                                     "METRICS.jsonl.timeline.rank<r>.jsonl).")
    parser.add_argument("metrics", metavar="METRICS.jsonl", help="the run's --metrics-file")
    parser.add_argument("--step", type=int, default=None, metavar="N", help="which iteration (default: the last)")
    parser.add_argument("--png", required=True, metavar="FILE", help="the PNG file to write")
    args = parser.parse_args(argv)
    files = sorted(glob.glob(timeline_file(glob.escape(args.metrics), "*")))
    try:
        if not files:
            raise ValueError(f"no timeline beside it ({timeline_file(args.metrics, 0)}, ...): train with "
                             f"--timing-log-level 2 and --metrics-file {args.metrics}")
        ranks = [_timeline_steps(file) for file in files]
        step = args.step if args.step is not None else min(max(steps) for steps in ranks)
        missing = [file for file, steps in zip(files, ranks) if not steps.get(step, {}).get("spans")]
        if missing:
            raise ValueError(f"step {step} has no spans in {missing[0]}; give a --step every rank timed")
        draw_timeline([steps[step] for steps in ranks], args.png)
    except (OSError, ValueError, KeyError) as error:
        return _failed(error, args.metrics)
    print(f"wrote {args.png}")
    return 0


def breakdown_main(argv: list[str] | None = None, prog: str = "megatron-hetero breakdown") -> int:
    """`megatron-hetero breakdown RECORDS.jsonl --png F [--record N]`: a bench_e2e record's step per rank."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description="Draw a benchmarks/bench_e2e.py record's step per "
                                     "rank: seconds in each phase and waiting on other ranks.")
    parser.add_argument("records", metavar="RECORDS.jsonl", help="bench_e2e's JSON lines (one record a line)")
    parser.add_argument("--record", type=int, default=-1, metavar="N", help="which line (default: the last)")
    parser.add_argument("--png", required=True, metavar="FILE", help="the PNG file to write")
    args = parser.parse_args(argv)
    try:
        records = _read_lines(args.records, BENCH_WRITER)
        if not records:
            raise ValueError(f"no records; give a file {BENCH_WRITER} wrote")
        if not -len(records) <= args.record < len(records):
            raise ValueError(f"no record {args.record}: the file holds {len(records)}; give --record 0 to "
                             f"{len(records) - 1}")
        draw_breakdown(records[args.record], args.png)
    except (OSError, ValueError, KeyError) as error:
        return _failed(error, args.records)
    print(f"wrote {args.png}")
    return 0
