"""Colocated training of a vision encoder and an LLM, each in its own layout.

One step: encoder forward on its DP slice of the global batch, boundary forward into the LLM layout,
LLM forward/backward per microbatch (gradients accumulate on the boundary output), boundary backward,
encoder backward, DP reduction per module, one optimizer step clipped by the global norm.
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megatron_hetero.boundary import PlanCache, RankPlan, slot_mask
from megatron_hetero.cpu_compat import apply_cpu_compat
from megatron_hetero.data.batches import VISION, GlobalBatch, caption_batch, module_slice
from megatron_hetero.data.shapes import ShapesDataset, caption_accuracy
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.groups import ModuleGroups, build_groups
from megatron_hetero.layout import HeteroLayout
from megatron_hetero.mcore_globals import init_mcore_globals
from megatron_hetero.models.init import build_stage
from megatron_hetero.models.vlm import ModelSizes, build_llm, build_vision_encoder, llm_forward
from megatron_hetero.training.args import model_sizes
from megatron_hetero.schedules import colocated_step, non_colocated_step, route_rows
from megatron_hetero.training.optimizer import HeteroOptimizer, ModuleOptimizer, module_optimizer


def init_distributed() -> torch.device:
    """torchrun's environment -> default process group (nccl with GPUs, gloo without)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo")
    return torch.device("cpu")


@dataclass
class Module:
    """One module on this rank: its groups, its model (None if not held here) and the DDP wrapper
    that reduces its gradients (None if not held here or frozen)."""

    groups: ModuleGroups
    net: torch.nn.Module | None
    ddp: DistributedDataParallel | None

    @property
    def layout(self):
        return self.groups.layout

    def coords(self):
        return self.layout.coords(dist.get_rank())


def _wrap(model, pgs):
    """megatron-core DDP over the module's own DP group (summing: the loss is pre-divided). Its
    gradient hooks sit on the parameters, so the bare model is what the steps call."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    return DistributedDataParallel(model.config, ddp_config, model, pg_collection=pgs)


class Trainer:
    def __init__(self, args, layout: HeteroLayout, device: torch.device):
        apply_cpu_compat()
        self.args, self.layout, self.device = args, layout, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tokenizer = CaptionTokenizer()
        self.sizes: ModelSizes = model_sizes(args, self.tokenizer.vocab_size)
        # fp32 parameters and optimizer; --bf16 computes under autocast and sends bf16 rows.
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
        self.boundary_dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.train_data = ShapesDataset(args.data_seed, "train", self.sizes.image_size)
        self.eval_data = ShapesDataset(args.data_seed, "heldout", self.sizes.image_size)

        groups = build_groups(layout)
        (self.encoder_layout,) = layout.encoders  # one edge in this trainer
        # The RNG tracker wants one TP rank: the LLM's where the rank holds it.
        here = next(m for m in (layout.llm, self.encoder_layout) if m.coords(self.rank))
        init_mcore_globals(args.seed, tp_rank=here.coords(self.rank)["tp"])
        optimizers = []
        self.modules = {}
        for index, g in enumerate(groups.values()):
            net = ddp = None
            opt = ModuleOptimizer(g.layout.name, [], None, None)
            if g.pgs is not None:
                # Each module from its own seed: the same weights whatever else the rank holds.
                build = build_llm if g.layout.role == "llm" else build_vision_encoder
                net = build_stage(lambda whole: build(self.sizes, g.layout.tp, g.pgs, whole=whole),
                                  args.seed + index, g.layout.pp).to(device)
                if g.layout.freeze:  # no gradients, no reduction, no optimizer state
                    net.requires_grad_(False)
                else:
                    ddp = _wrap(net, g.pgs)
                    opt = module_optimizer(g.layout.name, net, g.pgs, args.lr, args.weight_decay)
            self.modules[g.layout.name] = Module(g, net, ddp)
            optimizers.append(opt)
        self.llm, self.encoder = self.modules[layout.llm.name], self.modules[self.encoder_layout.name]
        self.optimizer = HeteroOptimizer(optimizers, args.clip_grad, device)
        self.plans = PlanCache()
        self.patches = self.sizes.patches_per_image

    # ---- pieces the schedules combine ----------------------------------------------------------
    def plan(self, batch: GlobalBatch) -> RankPlan:
        return self.plans.plan(batch.boundaries[VISION], self.encoder_layout, self.layout.llm, self.rank,
                               self.world_size)

    def encode(self, batch: GlobalBatch) -> torch.Tensor:
        """This rank's encoder rows for its DP slice of `batch`, in the boundary dtype (empty off the
        encoder). A frozen encoder runs without a graph: nothing is routed back across its boundary."""
        enc = self.encoder.coords()
        if enc is None:
            return torch.zeros(0, self.sizes.hidden_size, device=self.device, dtype=self.boundary_dtype)
        images = batch.images(module_slice(len(batch.indices), self.encoder_layout.dp, enc["dp"]))
        with self.autocast, torch.set_grad_enabled(self.encoder.ddp is not None and torch.is_grad_enabled()):
            rows = self.encoder.net(images.to(self.device)).to(self.boundary_dtype)
        return rows * 0 if self.args.ablate_vision else rows

    def _llm_slice(self, batch: GlobalBatch, tensor: torch.Tensor) -> torch.Tensor:
        coords = self.llm.coords()
        return tensor[module_slice(len(batch.indices), self.layout.llm.dp, coords["dp"])].to(self.device)

    def _slot_views(self, batch: GlobalBatch, slots: torch.Tensor, plan: RankPlan):
        """Boundary slots and their mask as [S, b_local, h] and [S, b_local] (Megatron's layout)."""
        seq, b_local = batch.seq_len, len(batch.indices) // self.layout.llm.dp
        return slots.view(seq, b_local, -1), slot_mask(plan, self.device).view(seq, b_local)

    def llm_forward_backward(self, batch: GlobalBatch, slots: torch.Tensor, plan: RankPlan,
                             num_loss_tokens: int) -> torch.Tensor:
        """LLM forward and backward over this rank's share of `batch`, microbatch by microbatch,
        with `slots` [S * b_local, h] from the boundary (gradients accumulate on it). Returns the
        summed token loss; the loss backpropagated is divided by the global batch's token count."""
        ids, labels, loss_mask = (self._llm_slice(batch, t) for t in (batch.input_ids, batch.labels, batch.loss_mask))
        view, mask = self._slot_views(batch, slots, plan)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        m = self.args.micro_batch_size
        for start in range(0, ids.shape[0], m):
            mb = slice(start, start + m)
            with self.autocast:
                losses = llm_forward(self.llm.net, ids[mb], view[:, mb], mask[:, mb], labels[mb])
            local = (losses.float() * loss_mask[mb]).sum()
            (local / num_loss_tokens).backward()
            loss_sum += local.detach().double()
        return loss_sum

    def finish_step(self, loss_sum: torch.Tensor, num_loss_tokens: int) -> float:
        """Reduce every module's gradients over its own DP group; the global mean token loss."""
        for module in self.modules.values():
            if module.ddp is not None:
                module.ddp.finish_grad_sync()
        # Every LLM TP rank holds the same loss: count one per (dp) replica.
        llm_pgs = self.llm.groups.pgs
        if llm_pgs is not None and llm_pgs.tp.rank() != 0:
            loss_sum = torch.zeros_like(loss_sum)
        dist.all_reduce(loss_sum)
        return loss_sum.item() / num_loss_tokens

    def train_step(self, batch: GlobalBatch) -> float:
        """Forward and backward of one global batch; returns the global mean token loss."""
        step = colocated_step if self.layout.placement == "colocated" else non_colocated_step
        return step(self, batch)

    def lr(self, step: int) -> float:
        a = self.args
        if a.lr_warmup_iters and step < a.lr_warmup_iters:
            return a.lr * (step + 1) / a.lr_warmup_iters
        if a.min_lr is None:
            return a.lr
        progress = (step - a.lr_warmup_iters) / max(1, a.train_iters - a.lr_warmup_iters)
        return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * progress))

    def batch(self, step: int) -> GlobalBatch:
        g = self.args.global_batch_size
        return caption_batch(self.train_data, list(range(step * g, (step + 1) * g)), self.tokenizer,
                             self.patches, self.sizes.seq_length)

    def zero_grad(self):
        for module in self.modules.values():
            if module.ddp is not None:
                module.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    # ---- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate_captions(self, indices: list[int]) -> list[str]:
        """Greedy captions of held-out images, in index order (on every rank)."""
        batch = caption_batch(self.eval_data, indices, self.tokenizer, self.patches,
                              self.sizes.seq_length, with_captions=False)
        plan = self.plan(batch)
        slots = route_rows(self.encode(batch), plan, self.layout.placement == "colocated")
        mine = []
        if self.llm.coords() is not None:
            ids = self._llm_slice(batch, batch.input_ids)
            view, mask = self._slot_views(batch, slots, plan)
            vocab = self.tokenizer.vocab_size
            for t in range(1 + self.patches, ids.shape[1]):
                with self.autocast:
                    logits = llm_forward(self.llm.net, ids, view, mask)
                ids[:, t] = logits[:, t - 1, :vocab].argmax(-1)
            if self.llm.groups.pgs.tp.rank() == 0:
                start = module_slice(len(indices), self.layout.llm.dp, self.llm.coords()["dp"]).start
                mine = [(start + i, self.tokenizer.decode(row.tolist())) for i, row in enumerate(ids)]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        return [caption for _, caption in sorted(sum(gathered, []))]

    def evaluate(self, num_samples: int) -> float:
        indices = list(range(num_samples))
        captions = self.generate_captions(indices)
        return caption_accuracy(captions, [self.eval_data[i] for i in indices])


def log(rank: int, *parts):
    if rank == 0:
        print(*parts, flush=True)


def train(args, layout: HeteroLayout, device: torch.device, on_step=None) -> Trainer:
    """The training loop: logs Megatron-style lines and writes one JSON object per step."""
    trainer = Trainer(args, layout, device)
    rank = trainer.rank
    metrics = None
    if args.metrics_file and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)
        metrics = open(args.metrics_file, "w")
    start = time.perf_counter()
    for step in range(args.train_iters):
        t0 = time.perf_counter()
        batch = trainer.batch(step)
        trainer.zero_grad()
        loss = trainer.train_step(batch)
        if on_step is not None:
            on_step(trainer, step, "grads")
        lr = trainer.lr(step)
        grad_norm = trainer.optimizer.step(lr)
        if on_step is not None:
            on_step(trainer, step, "params")
        elapsed = time.perf_counter() - t0
        tokens_per_s = batch.input_ids.numel() / elapsed
        record = dict(step=step + 1, loss=loss, grad_norm=grad_norm, lr=lr,
                      tokens_per_s=tokens_per_s, elapsed_s=time.perf_counter() - start)
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if (step + 1) % args.log_interval == 0:
            log(rank, f" iteration {step + 1:6d}/{args.train_iters:6d} | elapsed time per iteration "
                      f"(ms): {1000 * elapsed:8.1f} | learning rate: {lr:.3E} | lm loss: {loss:.6E} | "
                      f"grad norm: {grad_norm:.3f} | tokens/s: {tokens_per_s:9.1f}")
    if args.eval_samples:
        accuracy = trainer.evaluate(args.eval_samples)
        log(rank, f" caption accuracy on {args.eval_samples} held-out images: {accuracy:.3f}")
        if metrics:
            metrics.write(json.dumps(dict(caption_accuracy=accuracy, eval_samples=args.eval_samples)) + "\n")
    if metrics:
        metrics.close()
    sys.stdout.flush()
    return trainer
