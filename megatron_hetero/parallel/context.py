"""What one process holds in a heterogeneous run: the layout, every module's groups, and the stage of
each module it holds (built once, after torch.distributed is up; passed as an argument from there).

The description is frozen: the model build adds each module's stage and DDP wrapper as a new
description (`HeteroRun.with_parts`). What exists only while the run goes on (the model, its
optimizer, the watchdog, the phase) sits in one small object beside it, `RunHandles`.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel

from megatron_hetero.parallel.groups import ModuleGroups, build_groups
from megatron_hetero.spec.layout import ColocatedSchedule, HeteroLayout, ModuleLayout, Placement


class Phase(StrEnum):
    """What a rank is doing outside the schedules' named phases, as failure reports and heartbeats
    say it (HeteroRun.enter)."""

    SETUP = "setup"
    TRANSFERS = "the pipeline's transfers"
    GRADIENT_REDUCTION = "the gradient reduction"
    OPTIMIZER_STEP = "the optimizer step"  # and Megatron's logging, up to the next step


@dataclass(frozen=True)
class ModuleRuntime:
    """One module on this rank: its groups (pgs None where not held), its stage `part` and the DDP
    wrapper reducing its gradients (None where not held or frozen)."""

    groups: ModuleGroups
    part: torch.nn.Module | None = None
    ddp: DistributedDataParallel | None = None

    @property
    def layout(self) -> ModuleLayout:
        return self.groups.layout

    @property
    def name(self) -> str:
        return self.groups.layout.name

    @property
    def held(self) -> bool:
        return self.groups.pgs is not None

    @property
    def pgs(self):
        return self.groups.pgs

    def coords(self) -> dict | None:
        return self.layout.coords(dist.get_rank())

    @property
    def first_stage(self) -> bool:
        return self.held and self.coords()["pp"] == 0

    @property
    def last_stage(self) -> bool:
        return self.held and self.coords()["pp"] == self.layout.pp - 1


@dataclass
class RunHandles:
    """What a run gains once it goes on, each set once by the code that makes it: the HeteroModel
    (runtime/wrap.py), its per-module optimizers (patches/hetero_optimizer.py), this rank's
    heartbeats (patches/faults.py); the coarse phase follows the step (HeteroRun.enter)."""

    model: torch.nn.Module | None = None
    optimizer: object = None  # megatron-core MimoOptimizer over the modules' optimizers
    watchdog: object = None  # runtime/watchdog.py
    phase: Phase = Phase.SETUP
    # A launcher's further advice out of GPU memory (the benchmarks' planner answer), else None.
    memory_advice: Callable[[], str] | None = None


@dataclass(frozen=True)
class HeteroRun:
    """This process's view of a run: every module's runtime, in layout order."""

    layout: HeteroLayout
    rank: int
    modules: dict[str, ModuleRuntime] = field(default_factory=dict)
    colocated_schedule: ColocatedSchedule = ColocatedSchedule.RECOMPUTE  # colocated, LLM pp > 1
    # An ordered colocated schedule (not recompute): world groups of their own for the boundary's
    # rows and its gradients, so that their point-to-point messages never pair with the pipeline's
    # or each other's.
    boundary_groups: tuple | None = None
    handles: RunHandles = field(default_factory=RunHandles, compare=False)

    def with_parts(self, parts: dict[str, torch.nn.Module], ddps: dict[str, DistributedDataParallel]) -> "HeteroRun":
        """This description with the held modules' built stages and DDP wrappers (where trainable);
        the same handles."""
        return replace(self, modules={name: replace(m, part=parts.get(name), ddp=ddps.get(name))
                                      for name, m in self.modules.items()})

    def enter(self, phase: Phase) -> None:
        """This rank now does `phase` (failure reports and heartbeats say it)."""
        self.handles.phase = phase

    @property
    def llm(self) -> ModuleRuntime:
        return self.modules[self.layout.llm.name]

    @property
    def encoders(self) -> dict[str, ModuleRuntime]:
        return {m.name: self.modules[m.name] for m in self.layout.encoders}

    @property
    def encoders_here(self) -> dict[str, ModuleRuntime]:
        """The encoders this rank holds: in a colocated run every one, but for an encoder stacked on
        the LLM's first pipeline stage (layout on_first_stage), held by that stage's ranks only."""
        return {name: m for name, m in self.encoders.items() if m.held}

    @property
    def primary(self) -> ModuleRuntime:
        """The module whose groups stand for this rank where Megatron wants one set (its data
        parallel rank, its tensor-parallel broadcast, its loss reporting): the LLM where held,
        else the encoder this rank holds."""
        return next(m for m in (self.llm, *self.encoders.values()) if m.held)

    def __repr__(self) -> str:  # Megatron prints its args, this one among them
        return f"HeteroRun({self.layout.placement}, rank {self.rank})"


def build_run(layout: HeteroLayout, colocated_schedule: str = ColocatedSchedule.RECOMPUTE) -> HeteroRun:
    """Collective over the world: every module's process groups."""
    groups = build_groups(layout)
    boundary_groups = None
    colocated_schedule = ColocatedSchedule(colocated_schedule)
    if (layout.placement == Placement.COLOCATED and layout.llm.pp > 1
            and colocated_schedule != ColocatedSchedule.RECOMPUTE):
        boundary_groups = tuple(dist.new_group(list(range(layout.world_size))) for _ in ("rows", "grads"))
    return HeteroRun(layout, dist.get_rank(), {name: ModuleRuntime(g) for name, g in groups.items()},
                     colocated_schedule=colocated_schedule, boundary_groups=boundary_groups)
