"""One training (or evaluation) step of a heterogeneous run inside megatron.training's loop: what the
schedules (schedules/colocated.py, schedules/non_colocated.py) run it with.

Megatron's loop hands the forward-backward function (schedules/forward_backward.py) the data
iterator and the script's `forward_step(data_iterator, model)`, which reads a batch and calls
`model(...)` with it. A heterogeneous step needs every microbatch's arguments before any module runs
(each edge's boundary plan is computed from them) and runs each module's part on its own ranks.
`ScriptCalls` says how the forward step serves that; `StepContext` holds the step's microbatches,
their boundary plans, and the parts of a step the schedules compose: an encoder's forward on a
microbatch, the LLM stage's forward through the script's forward step (`LLMView` as its `model`),
and a backward through some modules (`GradSync` keeps DDP's gradient reduction for each module's
last one).

Data: every rank's iterator yields global microbatches (micro batch size x LLM dp samples; see
patches/hetero_data.py). The LLM's DP ranks take contiguous slices of the samples
(layout.dp_samples); an encoder's DP ranks take the items (images, clips) the boundary metadata
assigns them by cost (boundary/balance.py), possibly none.
"""

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from megatron.core.pipeline_parallel.schedules import forward_step

from megatron_hetero.boundary import PlanCache, check_agreement
from megatron_hetero.boundary.transfer import annotate
from megatron_hetero.parallel.context import HeteroRun, ModuleRuntime
from megatron_hetero.runtime.model import Adapter, ModelCall
from megatron_hetero.runtime.timers import Clock, PhaseTimers


class _Capture:
    """A `model` that records the script's call (the forward step's outputs are discarded)."""

    call: ModelCall | None = None

    def set_input_tensor(self, tensor):
        pass

    def __call__(self, *args, **kwargs):
        self.call = ModelCall(args, kwargs)
        return None, None


@dataclass
class ScriptCalls:
    """The script's forward step and the step's microbatches: the forward step is captured once per
    microbatch and replayed once more on ranks that hold the LLM.

    Per microbatch i:
    1. `capture` (every rank, before anything runs): the iterator's microbatch i is read once, and
       the forward step runs on it with a `model` that records its arguments (`calls[i]`, a
       ModelCall); the boundary plans and every encoder's forward work from these;
    2. `replay(i)` (ranks holding the LLM, as the LLM stage runs i): the forward step runs again on
       the same microbatch (an iterator of it alone), through megatron-core's forward_step with the
       LLM stage as `model` (LLMView); on the last stage its loss function runs.
    So the script's forward step runs twice per microbatch where the LLM is held, once elsewhere.
    A script author must let it run again on the same batch: read the batch from the iterator it is
    given and change nothing else. Megatron-LM's get_batch broadcasts over the tensor-parallel group
    at each call: every rank of a module's TP group runs the forward step as often, so those
    broadcasts pair."""

    forward_step_func: Callable
    items: list  # microbatch i's raw data (None where this rank has no iterator)
    calls: list = field(default_factory=list)  # microbatch i's model arguments, once captured

    def capture(self) -> None:
        for i in range(len(self.items)):
            view = _Capture()
            self.forward_step_func(self.replay(i), view)
            self.calls.append(view.call)

    def replay(self, i: int):
        return None if self.items[i] is None else iter([self.items[i]])


class GradSync:
    """Megatron's no_sync convention, per module: every backward of a step through a module runs
    under its DDP's no_sync but the last, whose gradient hooks then issue the buckets' reductions
    (with --overlap-grad-reduce, overlapping that backward). Every schedule runs one backward per
    microbatch through each trainable module a rank holds (one per group of k for an encoder
    batched over k microbatches, layout `microbatches`, the last group possibly shorter), so a
    module's last backward is its ceil(num_microbatches / k)-th: `before` counts them."""

    def __init__(self, run: HeteroRun, num_microbatches: int):
        self.held = {name: m.ddp.no_sync() for name, m in run.modules.items() if m.ddp is not None}
        for context in self.held.values():
            context.__enter__()
        self.remaining = {name: -(-num_microbatches // run.modules[name].layout.microbatches) for name in self.held}

    def before(self, modules: list[ModuleRuntime]) -> None:
        """A backward through `modules` is about to run."""
        for module in modules:
            if module.name in self.remaining:
                self.remaining[module.name] -= 1
                assert self.remaining[module.name] >= 0, f"more backwards through {module.name} than microbatches"
                if self.remaining[module.name] == 0:  # its last: the hooks may reduce
                    self.held.pop(module.name).__exit__(None, None, None)

    def release(self) -> None:
        """End of the step (or a failure): every module still held is released."""
        for context in self.held.values():
            context.__exit__(None, None, None)
        self.held.clear()


class EncoderInputs:
    """The encoders' first-stage inputs of a step, each pass's made while the pass before it
    computes. On a GPU they are made on a stream of their own: made in the compute stream's order,
    a pass's inputs (a Qwen2.5-VL microbatch's 26,144 x 1,176 fp32 patches copied from pinned host
    memory: ~2.4 ms on an H200) held every kernel queued after them. Elsewhere they are made at once."""

    def __init__(self, adapter: Adapter, device: torch.device):
        self.adapter = adapter
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead = {}  # (encoder, first microbatch, microbatches) -> (inputs, their ready event or None)

    def start(self, module: ModuleRuntime, key: tuple, share: list) -> None:
        """Make the inputs of a pass (`key`: its first microbatch and count; `share` as in
        Adapter.encoder_inputs), on the stream of their own after the work queued so far (tensors
        of the script's may come from the compute stream)."""
        if (module.name, *key) in self.ahead:
            return
        ready = None
        with torch.no_grad(), annotate("encoder inputs"):
            if self.stream is None:
                inputs = first_stage_inputs(self.adapter, module, share)
            else:
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    inputs = first_stage_inputs(self.adapter, module, share)
                    ready = torch.cuda.Event()
                    ready.record()
        self.ahead[module.name, *key] = inputs, ready

    def take(self, module: ModuleRuntime, key: tuple, share: list):
        """The inputs of that pass: those made ahead (the compute stream waits for them), else made now."""
        made = self.ahead.pop((module.name, *key), None)
        if made is None:
            return first_stage_inputs(self.adapter, module, share)
        inputs, ready = made
        if ready is not None:
            compute = torch.cuda.current_stream()
            compute.wait_event(ready)
            for tensor in _tensors(inputs):
                if tensor.is_cuda:  # its memory not reused before the compute stream is done with it
                    tensor.record_stream(compute)
        return inputs


def first_stage_inputs(adapter: Adapter, module: ModuleRuntime, share: list):
    """What an encoder's first stage takes for `share` (Adapter.encoder_inputs), or None from an
    adapter without encoder_inputs (its encoder_forward makes them)."""
    make = getattr(adapter, "encoder_inputs", None)
    return None if make is None else make(module, share)


def _tensors(inputs) -> list[torch.Tensor]:
    values = inputs.values() if isinstance(inputs, dict) else inputs or ()
    return [v for v in values if isinstance(v, torch.Tensor)]


@dataclass
class StepContext:
    """What the schedules need for one step: the run, the script's calls, their boundary plans, and
    the parts of the step (encoder forward, LLM forward step, backward)."""

    run: HeteroRun
    adapter: Adapter
    script: ScriptCalls
    config: object  # the primary module's TransformerConfig: Megatron's schedule settings
    forward_only: bool
    clock: Clock
    timers: PhaseTimers
    plan_caches: dict  # encoder name -> PlanCache, kept by the model across steps
    batch_size: int = 0  # samples in a global microbatch
    plans: dict = field(default_factory=dict)  # encoder name -> [RankPlan per microbatch]
    batches: dict = field(default_factory=dict)  # (encoder name, microbatch) -> its BoundaryBatch
    losses: list = field(default_factory=list)  # Megatron's forward_data_store (last LLM stage)
    num_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int))
    grad_sync: GradSync | None = None  # training steps: set by `prepare`
    inputs: EncoderInputs | None = None  # set by `prepare`

    @property
    def num_microbatches(self) -> int:
        return len(self.script.items)

    @property
    def calls(self) -> list[ModelCall]:
        return self.script.calls

    def share(self, module: ModuleRuntime) -> slice:
        """The samples of a global microbatch that the module's data-parallel rank takes."""
        return module.layout.dp_samples(self.batch_size, module.coords()["dp"])

    def encoder_items(self, module: ModuleRuntime, i: int) -> torch.Tensor:
        """The items of microbatch i that encoder `module`'s data-parallel rank encodes (indices into
        the microbatch's items, in order)."""
        batch, dp = self.batches[module.name, i], module.coords()["dp"]
        return torch.from_numpy(np.flatnonzero(batch.items_of(dp, module.layout.dp)))

    def _pass(self, module: ModuleRuntime, i: int, k: int) -> list[tuple[ModelCall, torch.Tensor]]:
        """(call, its items here) of each microbatch of the encoder's pass over i..i+k-1."""
        return [(self.calls[j], self.encoder_items(module, j)) for j in range(i, i + k)]

    @staticmethod
    def _encoded(share: list) -> list:
        """The pass's microbatches with items here: what the adapter's encoder calls take."""
        return [(call, items) for call, items in share if len(items)]

    def _start_inputs(self, module: ModuleRuntime, i: int) -> None:
        """Begin making the first-stage inputs of the encoder's pass at microbatch i, if the step has
        it and this rank encodes items there."""
        if i < self.num_microbatches:
            k = min(module.layout.microbatches, self.num_microbatches - i)
            share = self._encoded(self._pass(module, i, k))
            if share:
                self.inputs.start(module, (i, k), share)

    def prepare(self) -> None:
        """Every microbatch's model call (ScriptCalls.capture) and, from them, every edge's boundary
        plan; a training step's modules under no_sync (GradSync)."""
        with annotate("capture"):
            self.script.capture()
        self.batch_size = self.adapter.batch_size(self.calls[0])
        layout = self.run.layout
        M = self.num_microbatches
        # An encoder's items are balanced over its DP ranks per pass: over k microbatches for one
        # batched over k (a step of fewer, e.g. caption evaluation's one, ends with a shorter pass).
        self.batches = batches = {
            (e.name, i + j): batch for e in layout.encoders for i in range(0, M, e.microbatches)
            for j, batch in enumerate(self.adapter.boundary_batches(e.name, self.calls[i:i + e.microbatches]))}
        device = self.adapter.boundary_like().device
        self.inputs = EncoderInputs(self.adapter, device)
        for encoder in self.run.encoders.values():
            if encoder.first_stage:  # its first pass's inputs move while the host plans
                self._start_inputs(encoder, 0)
        self.num_tokens = self.num_tokens.to(device)
        # Plans from metadata that differs between ranks would not pair up: check it first.
        check_agreement({f"{name} (microbatch {i})": b for (name, i), b in batches.items()}, device)
        with annotate("plans"):
            for encoder in layout.encoders:
                cache = self.plan_caches.setdefault(encoder.name, PlanCache())
                self.plans[encoder.name] = [
                    cache.plan(batches[encoder.name, i], encoder, layout.llm, self.run.rank, layout.world_size)
                    for i in range(self.num_microbatches)]
        if not self.forward_only:
            self.grad_sync = GradSync(self.run, self.num_microbatches)

    def finish(self) -> None:
        """The step's end (or a failure): every module's gradient reduction released."""
        if self.grad_sync is not None:
            self.grad_sync.release()
        self.inputs = None

    # ---- the parts of a step ---------------------------------------------------------------------
    def encoder_forward(self, module: ModuleRuntime, i: int, hidden=None, k: int = 1) -> torch.Tensor:
        """This rank's stage of encoder `module` on microbatches i..i+k-1 (k > 1: an unpipelined
        encoder batched over them), on the captured calls: its rows on the last stage, microbatch
        after microbatch. A DP rank without items runs nothing: its output is empty, on a
        trainable last stage a leaf that needs grad, so that the colocated boundary's backward
        still runs its exchange."""
        share = self._pass(module, i, k)
        trainable = module.ddp is not None and torch.is_grad_enabled()
        first = hidden is None
        with self.timers("encoder-forward", module.name):
            encoded = self._encoded(share)
            if not encoded:
                output = (self.adapter.boundary_like().requires_grad_(trainable) if module.last_stage
                          else self.adapter.stage_hidden_like(module, *share[0]))
            else:
                if first:
                    hidden = self.inputs.take(module, (i, k), encoded)
                with torch.set_grad_enabled(trainable):
                    output = self.adapter.encoder_forward(module, encoded, hidden)
            if first:  # the next pass's inputs, once this pass's kernels are queued (the GPU not held up)
                self._start_inputs(module, i + k)
            return output

    def llm_forward_step(self, i: int, view: "LLMView") -> list:
        """Megatron's forward_step on microbatch i, the script's forward step replayed with `view` as
        its model: [the stage's output]; on the last LLM stage the script's loss function runs, its
        report joins `losses` and its token count `num_tokens`."""
        llm = self.run.llm
        with self.timers("llm-forward", llm.name):
            output, num_tokens = forward_step(
                self.script.forward_step_func, self.script.replay(i), view, self.num_microbatches, [None],
                self.losses, self.config, llm.layout.cp, is_last_stage=llm.last_stage)
        self.num_tokens += num_tokens.to(self.num_tokens.device)
        return output

    def backward(self, modules: list[ModuleRuntime], inputs: list, outputs: list, output_grads: list) -> list:
        """Backpropagate a stage's output through `modules` (the loss on the last LLM stage, scaled by
        Megatron's loss scale) and return the gradients of `inputs` (None entries stay None).
        Megatron's own backward_step expects outputs its schedules have pseudo-freed; ours are still
        in flight."""
        self.grad_sync.before(modules)
        for x in inputs:
            if x is not None:
                x.retain_grad()
        output, grad = outputs[0], output_grads[0]
        if grad is None and self.config.grad_scale_func is not None:
            output = self.config.grad_scale_func(output)
        if output.requires_grad:
            torch.autograd.backward(output, grad_tensors=grad)
        return [None if x is None else x.grad for x in inputs]


class LLMView:
    """`model` for the LLM stage in the script's replayed forward step: `media` (encoder name ->
    Media: the rows the boundary delivered) on the first stage, the previous stage's output
    `hidden` on later ones."""

    def __init__(self, ctx: StepContext, media: dict, hidden=None):
        self.ctx, self.media, self.hidden = ctx, media, hidden

    def set_input_tensor(self, tensor):
        pass  # the input (hidden) is already held

    def __call__(self, *args, **kwargs):
        llm = self.ctx.run.llm
        return self.ctx.adapter.llm_forward(llm, ModelCall(args, kwargs), self.ctx.share(llm),
                                            self.media, self.hidden)
