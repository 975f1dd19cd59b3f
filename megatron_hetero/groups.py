"""Process groups per module, from its layout: megatron-core HyperCommGrid + ProcessGroupCollection.

Group creation is collective over the whole world: every rank builds every module's groups, in the
layout's module order, also for modules it does not hold (it then gets None groups for them).
`init_distributed` starts the world itself where megatron.training does not (the tools).
"""

import copy
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_hetero.layout import HeteroLayout, ModuleLayout

# tp fastest: Megatron's tp-cp-dp-pp order. "ep" has size 1 here: expert parallelism has a grid of
# its own over the same ranks (Megatron's expert rank order, expert tp fastest, then ep, dp, pp).
GRID_AXES = ["tp", "cp", "ep", "dp", "pp"]
EXPERT_GRID_AXES = ["tp", "ep", "dp", "pp"]


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None) -> torch.device:
    """torchrun's environment -> the default process group, and this rank's device: NCCL on the
    LOCAL_RANK GPU where GPUs are present, else gloo on the CPU (`backend` overrides the choice)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend != "nccl":
        dist.init_process_group(backend, timeout=timeout)
        return torch.device("cpu")
    # NVLink multicast stays off (shared hosts); set before NCCL reads the environment.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return device


@dataclass
class ModuleGroups:
    """One module's groups on this rank; `pgs` is None where this rank does not hold the module."""

    layout: ModuleLayout
    grid: HyperCommGrid
    pgs: ProcessGroupCollection | None
    alone: dist.ProcessGroup | None = None  # this rank by itself (the dense grid's size-1 ep axis)

    def layer_groups(self) -> ProcessGroupCollection:
        """The groups the module's layers are built with: its own, but for an encoder replicated
        over cp (layout cp_replicated), whose layers see no CP (each replica encodes whole items);
        its DDP and optimizer keep dp_cp, over which the replicas' gradients sum."""
        if not self.layout.cp_replicated:
            return self.pgs
        pgs = copy.copy(self.pgs)
        pgs.cp, pgs.tp_cp = self.alone, self.pgs.tp
        return pgs

    def all_experts_here(self) -> ProcessGroupCollection:
        """The module's groups with expert parallelism folded into this rank (ep 1: every expert,
        on this rank's expert-tp slice): what building the whole module for layout-independent
        weights takes (models/init.py)."""
        pgs = copy.copy(self.pgs)
        pgs.ep, pgs.tp_ep = self.alone, self.pgs.expt_tp
        return pgs


def _first_and_last_stage_groups(grid: HyperCommGrid, rank: int):
    """Embedding groups as megatron-core builds them: (first, last) pp stage, and first stage alone."""
    embd = pos_embd = None
    for pp_ranks in grid.get_rank_enum("pp"):
        embd_ranks = sorted({pp_ranks[0], pp_ranks[-1]})
        group = dist.new_group(ranks=embd_ranks)
        if rank in embd_ranks:
            embd = group
        group = dist.new_group(ranks=[pp_ranks[0]])
        if rank == pp_ranks[0]:
            pos_embd = group
    return embd, pos_embd


def build_module_groups(module: ModuleLayout, backend: str | None = None) -> ModuleGroups:
    """Collective: create `module`'s process groups on every rank of the world."""
    shape = [module.tp, module.cp, 1, module.dp, module.pp]
    grid = HyperCommGrid(shape, GRID_AXES, rank_offset=module.first_rank, backend=backend)
    rank = dist.get_rank()
    groups = dict(
        tp=grid.create_pg("tp"),
        cp=grid.create_pg("cp"),
        dp=grid.create_pg("dp"),
        pp=grid.create_pg("pp"),
        ep=grid.create_pg("ep"),
        mp=grid.create_pg(["tp", "pp"]),
        tp_cp=grid.create_pg(["tp", "cp"]),
        dp_cp=grid.create_pg(["cp", "dp"]),
        tp_dp_cp=grid.create_pg(["tp", "cp", "dp"]),
        # One distributed-optimizer instance per module: all its ranks.
        intra_dist_opt=grid.create_pg(GRID_AXES),
    )
    embd, pos_embd = _first_and_last_stage_groups(grid, rank)
    experts = _expert_groups(module, groups, backend)
    if not grid.is_current_rank_in_grid():
        return ModuleGroups(module, grid, None)
    pgs = ProcessGroupCollection(**{**groups, **experts}, embd=embd, pos_embd=pos_embd)
    return ModuleGroups(module, grid, pgs, alone=groups["ep"])


def _expert_groups(module: ModuleLayout, dense: dict, backend: str | None) -> dict:
    """Collective: the expert groups megatron-core's MoE layers, DDP and optimizer take. Without
    an expert layout of its own (ep 1, etp = tp) they are the dense groups, an expert replicated
    like a dense weight over dp x cp."""
    if not module.has_expert_grid:
        return dict(expt_tp=dense["tp"], expt_dp=dense["dp_cp"], tp_ep=dense["tp"], tp_ep_pp=dense["mp"])
    grid = HyperCommGrid(module.expert_grid_shape(), EXPERT_GRID_AXES, rank_offset=module.first_rank,
                         backend=backend)
    return dict(
        ep=grid.create_pg("ep"),
        expt_tp=grid.create_pg("tp"),
        expt_dp=grid.create_pg("dp"),
        tp_ep=grid.create_pg(["tp", "ep"]),
        tp_ep_pp=grid.create_pg(["tp", "ep", "pp"]),
    )


def build_groups(layout: HeteroLayout, backend: str | None = None) -> dict[str, ModuleGroups]:
    """Collective: every module's groups, keyed by module name, in layout order."""
    return {m.name: build_module_groups(m, backend) for m in layout.modules}
