"""`--metrics-file FILE`: one JSON object per training iteration, written where Megatron logs
(megatron.training 0.19 `training.training_log`, called every iteration on every rank).

Each line: step, loss (Megatron's reported `lm loss`: the global mean over loss tokens), grad_norm,
lr, elapsed_s, tokens_per_s (samples x sequence length per second), under --hetero-layout the
writing rank's waiting_share (the share of the step it spent blocked on other ranks' data), and with
--num-experts the step's MoE losses as Megatron logs them (megatron-core's MoE metrics tracker:
load_balancing_loss, z_loss, ...; the mean over layers, microbatches and data-parallel ranks). Written by
the rank that holds the loss: the LLM's last stage at tp = cp = dp = 0 (the last rank without a layout).

With `--tensorboard-dir` or `--wandb-project` under --hetero-layout, Megatron's writers (on its last
rank) also get, every `--tensorboard-log-interval` iterations, since the last report:
- each module's waiting share (`hetero/waiting-share/<module>`: the mean over the ranks holding it;
  `.../max`: the largest of any rank);
- the bytes each module sent and received across the boundary to other ranks per training step
  (`hetero/boundary-bytes/<module>/sent|received`: the sum over its ranks, from the steps' plans);
- with `--timing-log-level 2` (our phase timers on: they synchronize the GPU at each phase's ends),
  the seconds per step of each phase (`hetero/phase-s/<phase>`: the mean over the ranks that run
  it; `.../max`: the largest).
One all-gather of a few floats per rank per report; nothing else communicates.

With `--timing-log-level 2` and `--metrics-file F` under --hetero-layout, every rank also writes its
steps' timelines to F.timeline.rank<r>.jsonl (runtime/timers.timeline_file), one line per iteration:
step, rank and the spans [phase, module, start, end] of the phase timers and of the waits, in
seconds of the host's monotonic clock (`megatron-hetero timeline F --png P` draws a step).
"""

import json
import os
import time

import torch
import torch.distributed as dist
from megatron.training import get_args, get_tensorboard_writer, get_wandb_writer

from megatron_hetero.patches._patch import replace
from megatron_hetero.runtime.timers import PHASES, timeline_file


class MetricsWriter:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, "w")
        self.start = time.perf_counter()
        self.last = None  # the previous record's time: a step's duration from the second on
        self.waited = 0.0

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


_writer: MetricsWriter | None = None  # this process's open metrics file (one per run)
_timeline: MetricsWriter | None = None  # this process's open timeline file (one per run)


def _writes_metrics(args) -> bool:
    run = args.hetero_run
    if run is None:
        return dist.get_rank() == dist.get_world_size() - 1
    llm = run.llm
    coords = llm.coords()
    return llm.last_stage and coords["tp"] == coords["cp"] == coords["dp"] == 0


def write_record(record: dict) -> None:
    """Append a record (e.g. the caption accuracy after training) to this process's metrics file."""
    if _writer is not None:
        _writer.write(record)


def _keeping_moe_scalars(original):
    """The tracker's per-step scalars, kept where the metrics record reads them."""
    def aggregate(self, *args, **kwargs):
        scalars = original(self, *args, **kwargs)
        self.last_scalars = {name: float(value) for name, value in scalars.items()}
        return scalars
    return aggregate


def _moe_losses() -> dict:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    scalars = getattr(get_moe_metrics_tracker(), "last_scalars", {})
    return {name: value for name, value in scalars.items() if name.endswith("loss")}


def _totals(model, names: list[str]) -> torch.Tensor:
    """This rank's phase seconds (PHASES) and per module its boundary bytes sent, then received."""
    seconds, traffic = model.timers.seconds, model.traffic
    return torch.tensor([seconds.get(p, 0.0) for p in PHASES] + [float(traffic.sent[n]) for n in names]
                        + [float(traffic.received[n]) for n in names], dtype=torch.float64)


def _module_scalars(run_args) -> dict:
    """Every rank's waiting share, phase seconds and boundary bytes since the last report, gathered
    (a collective: every rank calls this at the same iterations); per module and the largest."""
    run = run_args.hetero_run
    model, layout = run.handles.model, run.layout
    reported = model.reported
    names = [m.name for m in layout.modules]
    step_s = model.clock.step_s - reported.step_s
    share = (model.clock.waiting_s - reported.waiting_s) / step_s if step_s > 0 else 0.0
    reported.waiting_s, reported.step_s = model.clock.waiting_s, model.clock.step_s
    totals = _totals(model, names)
    steps = max(model.traffic.steps - reported.steps, 1)
    mine = torch.cat([torch.tensor([share], dtype=torch.float64),
                      (totals - (reported.totals if reported.totals is not None else 0)) / steps])
    reported.totals, reported.steps = totals, model.traffic.steps
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gathered = [torch.zeros_like(mine, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine.to(device))
    table = torch.stack(gathered).cpu()  # [rank, share | phases | sent | received]
    scalars = {f"hetero/waiting-share/{m.name}": float(table[list(m.ranks), 0].mean()) for m in layout.modules}
    scalars["hetero/waiting-share/max"] = float(table[:, 0].max())
    for j, phase in enumerate(PHASES, start=1):
        ran = table[:, j][table[:, j] > 0]
        if len(ran):
            scalars[f"hetero/phase-s/{phase}"] = float(ran.mean())
            scalars[f"hetero/phase-s/{phase}/max"] = float(ran.max())
    bytes_at = 1 + len(PHASES)
    for k, m in enumerate(layout.modules):
        ranks = list(m.ranks)
        scalars[f"hetero/boundary-bytes/{m.name}/sent"] = float(table[ranks, bytes_at + k].sum())
        scalars[f"hetero/boundary-bytes/{m.name}/received"] = float(table[ranks, bytes_at + len(names) + k].sum())
    return scalars


def _to_writers(run_args, iteration: int) -> None:
    """The module scalars into Megatron's TensorBoard and W&B writers (on the rank that holds them)."""
    if not (run_args.tensorboard_dir or run_args.wandb_project) or run_args.hetero_run is None:
        return
    if iteration % run_args.tensorboard_log_interval:
        return
    scalars = _module_scalars(run_args)
    tensorboard, wandb = get_tensorboard_writer(), get_wandb_writer()
    for tag, value in scalars.items():
        if tensorboard:
            tensorboard.add_scalar(tag, value, iteration)
    if wandb:
        wandb.log(scalars, iteration)


def _write_timeline(run_args, iteration: int) -> None:
    """This rank's spans since the last iteration, to its timeline file where --metrics-file is given;
    taken either way (they would grow for the whole run)."""
    global _timeline
    if run_args.hetero_run is None or not run_args.hetero_run.handles.model.timers.enabled:
        return
    spans = run_args.hetero_run.handles.model.timers.spans
    if run_args.metrics_file:
        if _timeline is None:
            _timeline = MetricsWriter(timeline_file(run_args.metrics_file, dist.get_rank()))
        _timeline.write(dict(step=iteration, rank=dist.get_rank(), spans=[list(s) for s in spans]))
    spans.clear()


def _training_log(original):
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, *args, **kwargs):
        global _writer
        run_args = get_args()
        # Megatron's MoE metrics are reduced (collectively) inside: the record comes after.
        result = original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, *args, **kwargs)
        _to_writers(run_args, iteration)
        _write_timeline(run_args, iteration)
        if run_args.metrics_file and _writes_metrics(run_args):
            if _writer is None:
                _writer = MetricsWriter(run_args.metrics_file)
            now = time.perf_counter()
            step_s = None if _writer.last is None else now - _writer.last
            _writer.last = now
            grad_norm = kwargs.get("grad_norm", args[2] if len(args) > 2 else None)
            record = dict(step=iteration, loss=float(loss_dict["lm loss"]) if "lm loss" in loss_dict else None,
                          grad_norm=None if grad_norm is None else float(grad_norm), lr=learning_rate,
                          elapsed_s=now - _writer.start, tokens_per_s=None)
            if step_s:
                record["tokens_per_s"] = run_args.global_batch_size * run_args.seq_length / step_s
            if run_args.hetero_run is not None:
                clock = run_args.hetero_run.handles.model.clock
                record["waiting_share"] = (clock.waiting_s - _writer.waited) / step_s if step_s else None
                _writer.waited = clock.waiting_s
            if run_args.num_experts is not None:
                record.update(_moe_losses())
            _writer.write(record)
        return result
    return training_log


def apply() -> None:
    replace("megatron.core.transformer.moe.moe_logging.MoEMetricsTracker._aggregate", _keeping_moe_scalars,
            params=("self",))
    replace("megatron.training.training.training_log", _training_log,
            params=("loss_dict", "total_loss_dict", "learning_rate", "iteration", "loss_scale",
                    "report_memory_flag", "skipped_iter", "grad_norm"))
