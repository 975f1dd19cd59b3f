"""`--metrics-file FILE`: one JSON object per training iteration, written where Megatron logs
(megatron.training 0.19 `training.training_log`, called every iteration on every rank).

Each line: step, loss (Megatron's reported `lm loss`: the global mean over loss tokens), grad_norm,
lr, elapsed_s, tokens_per_s (samples x sequence length per second), under --hetero-layout the
writing rank's waiting_share (the share of the step it spent blocked on other ranks' data), and with
--num-experts the step's MoE losses as Megatron logs them (megatron-core's MoE metrics tracker:
load_balancing_loss, z_loss, ...; the mean over layers, microbatches and data-parallel ranks). Written by
the rank that holds the loss: the LLM's last stage at tp = cp = dp = 0 (the last rank without a layout).
"""

import json
import os
import time

import torch.distributed as dist
from megatron.training import get_args

from megatron_hetero.patches._patch import replace


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


def _training_log(original):
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, *args, **kwargs):
        global _writer
        run_args = get_args()
        # Megatron's MoE metrics are reduced (collectively) inside: the record comes after.
        result = original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, *args, **kwargs)
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
