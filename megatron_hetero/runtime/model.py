"""The model megatron.training sees in a heterogeneous run: one chunk holding this rank's stage of
every module it spans, each wrapped in megatron-core DDP over the module's own groups.

Megatron's loop calls `forward_step_func(data_iterator, model)`, and the script's forward step calls
`model(...)` with the microbatch. The schedules never call this model: the step captures the
script's calls and replays them with a *view* of it as `model` (schedules/step.py: ScriptCalls,
LLMView), and runs each module's stage through the model family's `Adapter`. What the arguments
mean (which are per sample, what an encoder returns, how rows enter the LLM) is the model family's
`Adapter` (models/llava.py for Megatron-LM's LLaVAModel, models/vlm.py for ours).
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_hetero.boundary import BoundaryBatch, RankPlan
from megatron_hetero.parallel.context import HeteroRun, ModuleRuntime
from megatron_hetero.parallel.parallel_state import pointed_at
from megatron_hetero.runtime.timers import Clock, PhaseTimers, Reported, Traffic


@dataclass
class Media:
    """What the boundary delivered to this LLM rank for one encoder and microbatch: the rows its
    input takes from the encoder [filled slots, h], in slot order, and the plan that says which
    slots they fill (boundary.filled_slots, boundary.input_rows)."""

    rows: torch.Tensor
    plan: RankPlan


@dataclass
class ModelCall:
    """The arguments of one `model(...)` call of the script: one global microbatch (every LLM
    data-parallel rank's samples, in rank order)."""

    args: tuple
    kwargs: dict


class Adapter(Protocol):
    """How a model family's call is served by per-module stages. Adapters call a module's bare stage
    (`module.part`): its DDP wrapper's gradient hooks sit on the parameters, so they fire anyway."""

    def batch_size(self, call: ModelCall) -> int:
        """Samples in the call's global microbatch."""

    def boundary_like(self) -> torch.Tensor:
        """An empty [0, llm hidden] tensor of the boundary's dtype and device."""

    def stage_hidden_like(self, module: ModuleRuntime, call: ModelCall, share, stage: int | None = None
                          ) -> torch.Tensor:
        """What `module`'s stages pass each other (shape, dtype, device) for `share`: the LLM's
        samples (a slice), an encoder's items (an index tensor, possibly empty); what stage `stage`
        of the module takes in (None: this rank's stage; the LLM's may differ per stage)."""

    def boundary_batches(self, name: str, calls: list[ModelCall]) -> list[BoundaryBatch]:
        """Metadata of encoder `name`'s rows for the microbatch of each call (identical on every
        rank), the items of all of them assigned together to the encoder's DP ranks
        (boundary.assign_items): the microbatches one pass of the encoder takes."""

    def encoder_inputs(self, module: ModuleRuntime, share: list[tuple[ModelCall, torch.Tensor]]):
        """Optional. What the first stage of an encoder takes for `share` (as in encoder_forward),
        on this rank's device: the calls' items selected, moved and cast, nothing else (the step
        makes them a pass ahead, on a GPU on a stream of their own: schedules/step.py EncoderInputs)."""

    def encoder_forward(self, module: ModuleRuntime, share: list[tuple[ModelCall, torch.Tensor]], x):
        """This rank's stage of an encoder on the items of one or more microbatches: `share` holds
        (call, items: indices into its items) per microbatch, at least one item in all; several
        only for an unpipelined encoder. `x`: the stage's input, on the first stage what
        encoder_inputs(module, share) returned (None from an adapter without encoder_inputs: then
        this makes them), on later ones the previous stage's output. The last stage returns its
        rows [n, h], microbatches and their items in order."""

    def llm_forward(self, module: ModuleRuntime, call: ModelCall, share: slice, media: dict, hidden):
        """This rank's LLM stage on samples `share`; `media`: encoder name -> Media (first stage),
        `hidden`: the previous stage's output (later stages).
        Returns what the script's model returns."""


@dataclass
class ModelParts:
    """What a model provider returns under `--hetero-layout`: this rank's stage of every module it
    holds (module name -> stage), and how the script's model call maps onto them."""

    parts: dict
    adapter: Adapter


class HeteroModel(torch.nn.Module):
    """Megatron's model chunk in a heterogeneous run (see the module docstring)."""

    def __init__(self, run: HeteroRun, adapter: Adapter):
        super().__init__()
        self.run, self.adapter = run, adapter
        # Held parts, DDP-wrapped where trainable: parameters and state_dict keys by module name.
        self.parts = torch.nn.ModuleDict({
            m.name: m.ddp if m.ddp is not None else m.part for m in run.modules.values() if m.held})
        primary = run.primary
        self.config = primary.part.config
        self.pg_collection = primary.pgs
        self.force_all_reduce = False
        device = next(next(iter(self.parts.values())).parameters()).device
        self.clock = Clock(device)  # time spent waiting on other ranks' data
        self.timers = PhaseTimers(device)  # step-time breakdowns (benchmarks/bench_e2e.py turns them on)
        self.plan_caches = {}  # encoder name -> PlanCache
        row = adapter.boundary_like()
        self.traffic = Traffic(row.shape[1] * row.element_size())  # boundary bytes per module, from the plans
        self.reported = Reported()  # what the metrics writers were last given (patches/metrics.py)
        # Megatron's --check-for-nan-in-loss-and-grad for gradients, per module (finalize_hetero_grads)
        self.check_for_nan_in_grad = False

    def _held(self) -> list[ModuleRuntime]:
        return [m for m in self.run.modules.values() if m.held]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """What Megatron's torch_dist checkpoint stores of the model: each held module's megatron-core
        sharded state dict under `<module name>.`, built with the module's own groups (its tensor
        slices, its stages' global layer numbers, replicas over its dp x cp), so keys and global
        shapes do not depend on the layout that saved them."""
        assert not sharded_offsets, "a heterogeneous model is one chunk"
        out = {}
        for m in self._held():
            with pointed_at(m.pgs, self.run.primary.pgs):
                out.update(m.part.sharded_state_dict(prefix=f"{prefix}{m.name}.",
                                                     metadata={**(metadata or {}), "dp_cp_group": m.pgs.dp_cp}))
        return out

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        out = {} if destination is None else destination
        for m in self._held():
            m.part.state_dict(destination=out, prefix=f"{prefix}{m.name}.", keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """The inverse of state_dict / sharded_state_dict: keys `<module name>.<key in the module>`."""
        for m in self._held():
            head = m.name + "."
            m.part.load_state_dict({k[len(head):]: v for k, v in state_dict.items() if k.startswith(head)},
                                   strict=strict)

    def _trainable(self):
        return [m.ddp for m in self.run.modules.values() if m.ddp is not None]

    def zero_grad_buffer(self):
        for ddp in self._trainable():
            ddp.zero_grad_buffer()

    # megatron.training's --overlap-param-gather calls, on each DDP (the distributed optimizer's
    # parameter all-gather waits in forward pre-hooks).
    def enable_forward_pre_hook(self):
        for ddp in self._trainable():
            ddp.enable_forward_pre_hook()

    def disable_forward_pre_hook(self, param_sync: bool = True):
        for ddp in self._trainable():
            ddp.disable_forward_pre_hook(param_sync=param_sync)

    def start_param_sync(self, *unused, force_sync: bool = False):
        for ddp in self._trainable():
            ddp.start_param_sync(force_sync=force_sync)

    def free_overlap_buffers(self):
        for ddp in self._trainable():
            ddp.free_overlap_buffers()

    def set_input_tensor(self, input_tensor):
        raise RuntimeError("a heterogeneous model runs through megatron-hetero's schedules, which "
                           "call the script's forward step with a view of it")

    def forward(self, *args, **kwargs):
        raise RuntimeError("a heterogeneous model runs through megatron-hetero's schedules "
                           "(get_forward_backward_func is patched); call it through them")
