"""One training (or evaluation) step of a heterogeneous run inside megatron.training's loop.

`forward_backward` has the signature of megatron-core's forward-backward functions (what
`get_forward_backward_func()` returns; patches/hetero_schedule.py hands it out under
`--hetero-layout`). It builds a `StepContext` and runs the placement's schedule
(schedules/colocated.py, schedules/non_colocated.py), which call the script's forward step through
views of the model (`EncoderView`, `LLMView`, `ColocatedView`) and megatron-core's own
`forward_step` / `backward_step`, so the loss function, its scaling and the reported losses are
Megatron's.

Data: every rank's iterator yields global microbatches (micro batch size x LLM dp samples; see
patches/hetero_data.py). The step takes its microbatches from it once and replays microbatch i to the
forward step whenever a view of it runs (an encoder forward, the LLM stage, a recomputation). The
LLM's DP ranks take contiguous slices of the samples; an encoder's DP ranks take the items (images,
clips) the boundary metadata assigns them by cost (boundary/balance.py), possibly none.
"""

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from megatron.core.pipeline_parallel.schedules import forward_step
from torch.profiler import record_function

from megatron_hetero.boundary import PlanCache, boundary_exchange, check_agreement
from megatron_hetero.boundary.exchange import ANNOTATION
from megatron_hetero.data.batches import module_slice
from megatron_hetero.runtime.context import HeteroRun, ModuleRuntime
from megatron_hetero.runtime.model import Adapter, ModelCall, Media
from megatron_hetero.schedules.pipeline import Clock
from megatron_hetero.training.timers import PhaseTimers


@dataclass
class StepContext:
    """What the schedules need for one step: the run, the microbatches, their boundary plans, and
    how to call the script's forward step on microbatch i with a view of the model."""

    run: HeteroRun
    adapter: Adapter
    forward_step_func: Callable
    items: list  # microbatch i's raw data (None where this rank has no iterator)
    config: object  # the primary module's TransformerConfig: Megatron's schedule settings
    forward_only: bool
    clock: Clock
    timers: PhaseTimers
    plan_caches: dict
    calls: list = field(default_factory=list)  # microbatch i's model arguments
    batch_size: int = 0  # samples in a global microbatch
    plans: dict = field(default_factory=dict)  # encoder name -> [RankPlan per microbatch]
    batches: dict = field(default_factory=dict)  # (encoder name, microbatch) -> its BoundaryBatch
    losses: list = field(default_factory=list)  # Megatron's forward_data_store (last LLM stage)
    num_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int))
    held_sync: dict = field(default_factory=dict)  # module name -> its entered DDP no_sync context

    @property
    def num_microbatches(self) -> int:
        return len(self.items)

    def replay(self, i: int):
        return None if self.items[i] is None else iter([self.items[i]])

    def share(self, module: ModuleRuntime) -> slice:
        """The samples of a global microbatch that the LLM's data-parallel rank takes."""
        return module_slice(self.batch_size, module.layout.dp, module.coords()["dp"])

    def encoder_items(self, module: ModuleRuntime, i: int) -> torch.Tensor:
        """The items of microbatch i that encoder `module`'s data-parallel rank encodes (indices into
        the microbatch's items, in order)."""
        batch, dp = self.batches[module.name, i], module.coords()["dp"]
        return torch.from_numpy(np.flatnonzero(batch.items_of(dp, module.layout.dp)))

    def encoder_forward(self, module: ModuleRuntime, i: int, hidden=None) -> torch.Tensor:
        """Encoder stage forward on microbatch i through the adapter (rows on its last stage). A DP
        rank without items runs nothing: its output is empty, on a trainable last stage a leaf that
        needs grad, so that the colocated boundary's backward still runs its exchange."""
        call, items = self.calls[i], self.encoder_items(module, i)
        trainable = module.ddp is not None and torch.is_grad_enabled()
        if len(items) == 0:
            if module.last_stage:
                return self.adapter.boundary_like().requires_grad_(trainable)
            return self.adapter.stage_hidden_like(module, call, items)
        with torch.set_grad_enabled(trainable):
            return self.adapter.encoder_forward(module, call, items, hidden)

    def prepare(self) -> None:
        """Every microbatch's model arguments (one forward-step call each, through a capturing
        view) and, from them, every edge's boundary plan."""
        for i in range(self.num_microbatches):
            capture = _Capture()
            self.forward_step_func(self.replay(i), capture)
            self.calls.append(capture.call)
        self.batch_size = self.adapter.batch_size(self.calls[0])
        layout = self.run.layout
        self.batches = batches = {(e.name, i): self.adapter.boundary_batch(e.name, call)
                                  for e in layout.encoders for i, call in enumerate(self.calls)}
        device = self.adapter.boundary_like().device
        self.num_tokens = self.num_tokens.to(device)
        # Plans from metadata that differs between ranks would not pair up: check it first.
        check_agreement({f"{name} (microbatch {i})": b for (name, i), b in batches.items()}, device)
        with record_function(ANNOTATION + "plans"):
            for encoder in layout.encoders:
                cache = self.plan_caches.setdefault(encoder.name, PlanCache())
                self.plans[encoder.name] = [
                    cache.plan(batches[encoder.name, i], encoder, layout.llm, self.run.rank, layout.world_size)
                    for i in range(self.num_microbatches)]

    # ---- running parts of the model through the script's forward step --------------------------
    def run_encoder(self, module: ModuleRuntime, i: int, hidden=None) -> torch.Tensor:
        """Encoder stage forward on microbatch i (rows on its last stage)."""
        view = EncoderView(self, module, i, hidden)
        with self.timers("encoder-forward"):
            output, _ = self.forward_step_func(self.replay(i), view)
        return output

    def llm_forward_step(self, i: int, view) -> torch.Tensor:
        """Megatron's forward_step on microbatch i with `view` (an LLMView or ColocatedView): on the
        last LLM stage the script's loss function runs and its report joins `losses`."""
        llm = self.run.llm
        with self.timers("llm-forward"):
            output, num_tokens = forward_step(
                self.forward_step_func, self.replay(i), view, self.num_microbatches, view.inputs,
                self.losses, self.config, llm.layout.cp, is_last_stage=llm.last_stage)
        self.num_tokens += num_tokens.to(self.num_tokens.device)
        return output

    # ---- DDP gradient reduction (Megatron's no_sync convention) ---------------------------------
    def hold_grad_sync(self) -> None:
        """Every trainable module's backwards run under its DDP's no_sync until `last_backward`
        releases it: with --overlap-grad-reduce its buckets' reductions are issued from the hooks of
        its last backward of the step only, overlapping that backward."""
        for name, module in self.run.modules.items():
            if module.ddp is not None:
                self.held_sync[name] = module.ddp.no_sync()
                self.held_sync[name].__enter__()

    def last_backward(self, *modules: ModuleRuntime) -> None:
        """The next backward is the step's last one through `modules`: their hooks may reduce."""
        for module in modules:
            held = self.held_sync.pop(module.name, None)
            if held is not None:
                held.__exit__(None, None, None)

    def release_grad_sync(self) -> None:
        """End of the step (or a failure): every module still held is released."""
        self.last_backward(*[self.run.modules[name] for name in list(self.held_sync)])

    def backward(self, inputs: list, outputs: list, output_grads: list) -> list:
        """Backpropagate a stage's output (the loss on the last LLM stage, scaled by Megatron's loss
        scale) and return the gradients of `inputs` (None entries stay None). Megatron's own
        backward_step expects outputs its schedules have pseudo-freed; ours are still in flight."""
        for x in inputs:
            if x is not None:
                x.retain_grad()
        output, grad = outputs[0], output_grads[0]
        if grad is None and self.config.grad_scale_func is not None:
            output = self.config.grad_scale_func(output)
        if output.requires_grad:
            torch.autograd.backward(output, grad_tensors=grad)
        return [None if x is None else x.grad for x in inputs]


class _Capture:
    """A view that records the model call (the forward step's outputs are discarded)."""

    call: ModelCall | None = None

    def set_input_tensor(self, tensor):
        pass

    def __call__(self, *args, **kwargs):
        self.call = ModelCall(args, kwargs)
        return None, None


class EncoderView:
    """`model` for one encoder stage on microbatch i: returns (rows or hidden, None). The script's
    call is microbatch i's (captured in prepare)."""

    def __init__(self, ctx: StepContext, module: ModuleRuntime, i: int, hidden=None):
        self.ctx, self.module, self.i, self.hidden = ctx, module, i, hidden

    def set_input_tensor(self, tensor):
        pass

    def __call__(self, *args, **kwargs):
        return self.ctx.encoder_forward(self.module, self.i, self.hidden), None


class LLMView:
    """`model` for the LLM stage: `media` (encoder name -> slots) on the first stage, the previous
    stage's output `hidden` on later ones. `inputs`: what backward returns gradients for."""

    def __init__(self, ctx: StepContext, media: dict, hidden=None, inputs=None):
        self.ctx, self.media, self.hidden = ctx, media, hidden
        self.inputs = inputs if inputs else [None]

    def set_input_tensor(self, tensor):
        pass  # the input (hidden) is already held

    def __call__(self, *args, **kwargs):
        llm = self.ctx.run.llm
        return self.ctx.adapter.llm_forward(llm, ModelCall(args, kwargs), self.ctx.share(llm),
                                            self.media, self.hidden)


class ColocatedView:
    """`model` for one colocated microbatch without LLM pipelining: every encoder's forward, the
    boundary (autograd: its backward routes the row gradients back), the LLM's forward."""

    inputs = [None]

    def __init__(self, ctx: StepContext, i: int):
        self.ctx, self.i = ctx, i

    def set_input_tensor(self, tensor):
        pass

    def __call__(self, *args, **kwargs):
        ctx, call = self.ctx, ModelCall(args, kwargs)
        media = {}
        for name, module in ctx.run.encoders.items():
            with ctx.timers("encoder-forward"):
                rows = ctx.encoder_forward(module, self.i)
            plan = ctx.plans[name][self.i]
            with ctx.timers("boundary"):
                media[name] = Media(boundary_exchange(rows, plan), plan)
        llm = ctx.run.llm
        return ctx.adapter.llm_forward(llm, call, ctx.share(llm), media, None)
