"""One optimizer per module, clipped by one gradient norm over all modules.

Each module's gradients live in its megatron-core DDP buffer (`param.main_grad`, fp32). The global
norm: each module's squared norm summed over its TP and PP groups (every stage's parameters, TP
duplicates counted once), shared over the world with MAX so that ranks without the module agree, then
summed over modules. (megatron-core's optimizers and clip_grads allocate on CUDA, so the optimizer
here is torch's AdamW over fp32 parameters.)

Two ways to hold a module's optimizer state:
- replicated (default): DDP all-reduces the gradients over the module's DP (x CP) group and every DP
  rank steps AdamW over all of its parameters;
- distributed (`--use-distributed-optimizer`, ZeRO-1): DDP reduce-scatters each gradient bucket over
  the DP (x CP) group, so a DP rank holds the reduced gradient of its 1/dp shard of the bucket only.
  AdamW steps, for each parameter, the piece of it inside this rank's shard (views of DDP's contiguous
  param and grad buffers), so its state (exp_avg, exp_avg_sq) is 1/dp of the replicated case: the
  shards of the DP ranks add up to it exactly; a rank's share is 1/dp up to DDP's padding (parameter
  starts aligned to 64 elements, buckets to lcm(dp, 128)). After the step, DDP's param all-gather
  (`start_param_sync`) brings every rank the other shards. The norm sums the shards' squares over the
  DP (x CP) group as well; buffer layouts do not depend on the TP rank, so a parameter replicated over
  TP is cut the same way on every TP rank and counted on TP rank 0 only, as in the replicated case.
"""

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate


@dataclass
class ModuleOptimizer:
    """A module's optimizer on this rank; `optimizer` None if not held here. AdamW steps `params`
    (the parameters, or their pieces in this DP rank's shard) with `grads` (their reduced gradients);
    the norm squares `norm_grads` and sums them over `norm_groups`; `after_step` runs after a step."""

    name: str
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer | None
    pgs: ProcessGroupCollection | None
    grads: list[torch.Tensor] = field(default_factory=list)
    norm_grads: list[torch.Tensor] = field(default_factory=list)
    norm_groups: tuple = ()
    after_step: Callable[[], None] | None = None


def _shard_pieces(ddp: DistributedDataParallel):
    """(param piece, grad piece, parameter) for every parameter's part inside this DP rank's shard
    of each bucket: views of DDP's param and grad buffers."""
    assert not ddp.expert_parallel_buffers, "expert-parallel buffers are not sharded here"
    for buffer in ddp.buffers:
        dp, rank = buffer.data_parallel_group.size(), buffer.data_parallel_group.rank()
        for bucket in buffer.buckets:
            size = bucket.grad_data.numel() // dp
            lo, hi = rank * size, (rank + 1) * size
            for param in bucket.params_list:
                start, end = bucket.param_to_index[param]
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    yield bucket.param_data[a:b], bucket.grad_data[a:b], param


def module_optimizer(name, model, pgs, lr, weight_decay, ddp: DistributedDataParallel) -> ModuleOptimizer:
    """AdamW over the module's parameters, or over this DP rank's shard of them when `ddp` was built
    with use_distributed_optimizer."""
    if ddp.ddp_config.use_distributed_optimizer:
        pieces = list(_shard_pieces(ddp))
        params = [torch.nn.Parameter(p) for p, _, _ in pieces]  # aliases of the param buffer
        grads = [g for _, g, _ in pieces]
        norm_grads = [g for _, g, p in pieces if param_is_not_tensor_parallel_duplicate(p, pgs.tp)]
        norm_groups = (ddp.intra_dp_cp_group, pgs.mp)
        after_step = lambda: ddp.start_param_sync(force_sync=True)  # all-gather over DP (x CP)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.main_grad for p in params]
        norm_grads = [p.main_grad for p in params if param_is_not_tensor_parallel_duplicate(p, pgs.tp)]
        norm_groups, after_step = (pgs.mp,), None
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return ModuleOptimizer(name, params, optimizer, pgs, grads, norm_grads, norm_groups, after_step)


class HeteroOptimizer:
    def __init__(self, modules: list[ModuleOptimizer], clip_grad: float, device):
        self.modules = modules
        self.clip_grad = clip_grad
        self.device = device

    def _active(self):
        return [m for m in self.modules if m.optimizer is not None]

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Global L2 norm of all modules' DP-reduced gradients."""
        squares = torch.zeros(len(self.modules), dtype=torch.float64, device=self.device)
        for i, m in enumerate(self.modules):
            if m.optimizer is None:
                continue
            local = torch.zeros(1, dtype=torch.float64, device=self.device)
            for g in m.norm_grads:
                local += g.double().square().sum()
            for group in m.norm_groups:  # tp x pp, and dp x cp when sharded
                dist.all_reduce(local, group=group)
            squares[i] = local[0]
        dist.all_reduce(squares, op=dist.ReduceOp.MAX)
        return math.sqrt(squares.sum().item())

    @torch.no_grad()
    def step(self, lr: float) -> float:
        """Clip by the global norm and step every module; returns the norm before clipping."""
        norm = self.grad_norm()
        scale = min(1.0, self.clip_grad / (norm + 1e-6)) if self.clip_grad > 0 else 1.0
        for m in self._active():
            for p, g in zip(m.params, m.grads):
                p.grad = (g * scale).to(p.dtype)
            for group in m.optimizer.param_groups:
                group["lr"] = lr
            m.optimizer.step()
            if m.after_step is not None:
                m.after_step()
        return norm

    def zero_grad(self):
        for m in self._active():
            m.optimizer.zero_grad(set_to_none=True)
