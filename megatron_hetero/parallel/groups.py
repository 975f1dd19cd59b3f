"""Process groups per module, from its layout: megatron-core HyperCommGrid + ProcessGroupCollection.

Group creation is collective over the whole world: every rank builds every module's groups, in the
layout's module order, also for modules it does not hold (it then gets None groups for them).
`init_distributed` starts the world itself where megatron.training does not (the tools).

Groups share communicators where that cannot change the order of any rank's communication: each
NCCL communicator holds GPU memory once used, about 1.1 GiB for two H100s and 0.25 GiB for one
rank alone (benchmarks/gpu_nccl_memory.py, a colocated layout: 11.4 GiB outside PyTorch's allocator with
24 groups, 9 of them of the same two ranks). Within a module, groups of the same ranks that only run
collectives share one (a module's tp, mp, tp_cp, tp_dp_cp and distributed-optimizer groups are
often the same ranks); cp and pp keep their own (point-to-point rings and pipeline sends beside the
module's collectives), and so does each module (under pipelined colocated schedules the modules'
collectives interleave differently on different ranks; one stream per group keeps them apart).
Groups of one rank are shared by every module: nothing waits on another rank in them.
"""

import copy
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_hetero.spec.layout import HeteroLayout, ModuleLayout

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


class SharedGroups:
    """One module's groups, one per rank enumeration, and the world's one-rank groups (the module
    docstring says why). Collective like `dist.new_subgroups_by_enumeration`: every rank asks for
    the same groups in the same order."""

    def __init__(self, singles: dict, backend: str | None):
        self.made: dict[tuple, dist.ProcessGroup | None] = {}
        self.singles, self.backend = singles, backend

    def enumerated(self, rank_lists: list[list[int]], p2p: bool = False) -> dist.ProcessGroup | None:
        """This rank's group of `rank_lists` (None where it is in none); `p2p`: groups of more than
        one rank that carry point-to-point traffic, made anew."""
        key = tuple(map(tuple, rank_lists))
        single = all(len(ranks) == 1 for ranks in key)
        if p2p and not single:
            return dist.new_subgroups_by_enumeration(rank_lists, backend=self.backend)[0]
        made = self.singles if single else self.made
        if key not in made:
            made[key] = dist.new_subgroups_by_enumeration(rank_lists, backend=self.backend)[0]
        return made[key]

    def get(self, grid: HyperCommGrid, dims: str | list[str], p2p: bool = False) -> dist.ProcessGroup | None:
        """`grid.create_pg(dims)`, shared; `grid.get_pg(dims)` returns it too (upstream MIMO asks
        the grids for groups: benchmarks/bench_mimo.py)."""
        group = self.enumerated(grid.get_rank_enum(dims), p2p)
        names = [dims] if isinstance(dims, str) else dims
        # The key create_pg's docstring gives: the dims in the grid's reversed order, joined by "-".
        grid._pgs["-".join(d for d in reversed(grid.dim_names) if d in names)] = group
        assert grid.get_pg(dims) is group
        return group


def _first_and_last_stage_groups(grid: HyperCommGrid, shared: SharedGroups):
    """Embedding groups as megatron-core builds them: (first, last) pp stage, and first stage alone."""
    stages = grid.get_rank_enum("pp")
    return (shared.enumerated([sorted({ranks[0], ranks[-1]}) for ranks in stages]),
            shared.enumerated([[ranks[0]] for ranks in stages]))


def build_module_groups(module: ModuleLayout, backend: str | None = None,
                        singles: dict | None = None) -> ModuleGroups:
    """Collective: create `module`'s process groups on every rank of the world; `singles`: the
    world's one-rank groups so far (build_groups shares them among modules)."""
    shape = [module.tp, module.cp, 1, module.dp, module.pp]
    grid = HyperCommGrid(shape, GRID_AXES, rank_offset=module.first_rank, backend=backend)
    shared = SharedGroups({} if singles is None else singles, backend)
    groups = dict(
        tp=shared.get(grid, "tp"),
        cp=shared.get(grid, "cp", p2p=True),
        dp=shared.get(grid, "dp"),
        pp=shared.get(grid, "pp", p2p=True),
        ep=shared.get(grid, "ep"),
        mp=shared.get(grid, ["tp", "pp"]),
        tp_cp=shared.get(grid, ["tp", "cp"]),
        dp_cp=shared.get(grid, ["cp", "dp"]),
        tp_dp_cp=shared.get(grid, ["tp", "cp", "dp"]),
        # One distributed-optimizer instance per module: all its ranks.
        intra_dist_opt=shared.get(grid, GRID_AXES),
    )
    embd, pos_embd = _first_and_last_stage_groups(grid, shared)
    experts = _expert_groups(module, groups, shared, backend)
    if not grid.is_current_rank_in_grid():
        return ModuleGroups(module, grid, None)
    pgs = ProcessGroupCollection(**{**groups, **experts}, embd=embd, pos_embd=pos_embd)
    return ModuleGroups(module, grid, pgs, alone=groups["ep"])


def _expert_groups(module: ModuleLayout, dense: dict, shared: SharedGroups, backend: str | None) -> dict:
    """Collective: the expert groups megatron-core's MoE layers, DDP and optimizer take. Without
    an expert layout of its own (ep 1, etp = tp) they are the dense groups, an expert replicated
    like a dense weight over dp x cp."""
    if not module.has_expert_grid:
        return dict(expt_tp=dense["tp"], expt_dp=dense["dp_cp"], tp_ep=dense["tp"], tp_ep_pp=dense["mp"])
    grid = HyperCommGrid(module.expert_grid_shape(), EXPERT_GRID_AXES, rank_offset=module.first_rank,
                         backend=backend)
    return dict(
        ep=shared.get(grid, "ep"),
        expt_tp=shared.get(grid, "tp"),
        expt_dp=shared.get(grid, "dp"),
        tp_ep=shared.get(grid, ["tp", "ep"]),
        tp_ep_pp=shared.get(grid, ["tp", "ep", "pp"]),
    )


def build_groups(layout: HeteroLayout, backend: str | None = None) -> dict[str, ModuleGroups]:
    """Collective: every module's groups, keyed by module name, in layout order."""
    singles = {}
    return {m.name: build_module_groups(m, backend, singles) for m in layout.modules}
