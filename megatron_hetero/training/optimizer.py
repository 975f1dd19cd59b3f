"""One optimizer per module, clipped by one gradient norm over all modules.

Each module's gradients live in its megatron-core DDP buffer (`param.main_grad`, fp32, already
reduced over the module's own DP group). The global norm: each module's squared norm summed over its
TP and PP groups (every stage's parameters, TP duplicates counted once), shared over the world with
MAX so that ranks without the module agree, then summed over modules. (megatron-core's optimizers and clip_grads allocate on CUDA,
so the optimizer here is torch's AdamW over fp32 parameters.)
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate


@dataclass
class ModuleOptimizer:
    """A module's parameters and optimizer on this rank; `optimizer` None if not held here."""

    name: str
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    pgs: ProcessGroupCollection | None


def module_optimizer(name, model, pgs, lr, weight_decay) -> ModuleOptimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return ModuleOptimizer(name, params, torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay), pgs)


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
            unique = [p for p in m.params if param_is_not_tensor_parallel_duplicate(p, m.pgs.tp)]
            local = torch.zeros(1, dtype=torch.float64, device=self.device)
            for p in unique:
                local += p.main_grad.double().square().sum()
            dist.all_reduce(local, group=m.pgs.mp)  # tp x pp
            squares[i] = local[0]
        dist.all_reduce(squares, op=dist.ReduceOp.MAX)
        return math.sqrt(squares.sum().item())

    @torch.no_grad()
    def step(self, lr: float) -> float:
        """Clip by the global norm and step every module; returns the norm before clipping."""
        norm = self.grad_norm()
        scale = min(1.0, self.clip_grad / (norm + 1e-6)) if self.clip_grad > 0 else 1.0
        for m in self._active():
            for p in m.params:
                p.grad = (p.main_grad * scale).to(p.dtype)
            for group in m.optimizer.param_groups:
                group["lr"] = lr
            m.optimizer.step()
        return norm

    def zero_grad(self):
        for m in self._active():
            m.optimizer.zero_grad(set_to_none=True)
