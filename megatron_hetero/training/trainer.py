"""Training of encoders and an LLM, each in its own layout, colocated or not.

The trainer holds this rank's stage of every module it spans and the pieces the schedules combine
(microbatches, boundary plans, a stage's forward); one step is a schedule (schedules/) followed by
each module's DP reduction and one optimizer step clipped by the global gradient norm.
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megatron_hetero.boundary import PlanCache, RankPlan, check_agreement, slot_mask
from megatron_hetero.cpu_compat import apply_cpu_compat
from megatron_hetero.data.batches import AUDIO, VISION, GlobalBatch, caption_batch, module_slice
from megatron_hetero.data.shapes import ShapesDataset, caption_accuracy
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.groups import ModuleGroups, build_groups
from megatron_hetero.layout import HeteroLayout
from megatron_hetero.mcore_globals import init_mcore_globals
from megatron_hetero.models.context_parallel import cp_positions
from megatron_hetero.models.init import build_stage
from megatron_hetero.models.vlm import ModelSizes, build_audio_encoder, build_llm, build_vision_encoder, llm_forward
from megatron_hetero.schedules import colocated_step, non_colocated_step, route_media
from megatron_hetero.schedules.pipeline import Clock, run_stage
from megatron_hetero.schedules.stages import LLMStage
from megatron_hetero.training.args import model_sizes
from megatron_hetero.training.optimizer import HeteroOptimizer, ModuleOptimizer, module_optimizer
from megatron_hetero.training.timers import PhaseTimers


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
    """One module on this rank: its groups, its model stage (None if not held here) and the DDP
    wrapper that reduces its gradients (None if not held here or frozen)."""

    groups: ModuleGroups
    net: torch.nn.Module | None
    ddp: DistributedDataParallel | None

    @property
    def layout(self):
        return self.groups.layout

    def coords(self):
        return self.layout.coords(dist.get_rank())


@dataclass
class LLMInputs:
    """One microbatch as this LLM rank sees it: its DP slice, its CP positions."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor


def _wrap(model, pgs, distributed_optimizer: bool):
    """megatron-core DDP over the module's own DP (x CP) group (summing: the loss is pre-divided).
    Its gradient hooks sit on the parameters, so the bare model is what the steps call. With the
    distributed optimizer it reduce-scatters the gradients and keeps the parameters in one buffer."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    return DistributedDataParallel(model.config, ddp_config, model, pg_collection=pgs)


class Trainer:
    def __init__(self, args, layout: HeteroLayout, device: torch.device):
        apply_cpu_compat()
        self.args, self.layout, self.device = args, layout, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tokenizer = CaptionTokenizer()
        self.sizes: ModelSizes = model_sizes(args, self.tokenizer.vocab_size)
        # fp32 parameters and optimizer; --bf16 computes under autocast and sends bf16 activations.
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
        self.boundary_dtype = self.pipeline_dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.clock = Clock(device)
        self.timers = PhaseTimers(device)  # step-time breakdowns (tools/bench_e2e.py turns them on)
        self.layout_encoders = {m.name: m for m in layout.encoders}

        groups = build_groups(layout)
        # The RNG tracker wants one TP rank: the LLM's where the rank holds it.
        here = next(m for m in (layout.llm, *layout.encoders) if m.coords(self.rank))
        init_mcore_globals(args.seed, tp_rank=here.coords(self.rank)["tp"])
        optimizers = []
        self.modules = {}
        for index, g in enumerate(groups.values()):
            net = ddp = None
            opt = ModuleOptimizer(g.layout.name, [], None, None)
            if g.pgs is not None:
                # Each module from its own seed: the same weights whatever else the rank holds.
                net = build_stage(lambda whole: self._build(g, whole), args.seed + index, g.layout.pp).to(device)
                if g.layout.freeze:  # no gradients, no reduction, no optimizer state
                    net.requires_grad_(False)
                else:
                    ddp = _wrap(net, g.pgs, args.use_distributed_optimizer)
                    opt = module_optimizer(g.layout.name, net, g.pgs, args.lr, args.weight_decay, ddp)
            self.modules[g.layout.name] = Module(g, net, ddp)
            optimizers.append(opt)
        self.llm = self.modules[layout.llm.name]
        self.encoders = {name: self.modules[name] for name in self.layout_encoders}
        self.optimizer = HeteroOptimizer(optimizers, args.clip_grad, device)
        self.plans = {name: PlanCache() for name in self.encoders}

    def _dataset(self, split: str) -> ShapesDataset:
        """The demo data (built on first use: a benchmark feeding its own batches never needs it)."""
        return ShapesDataset(self.args.data_seed, split, self.sizes.image_size, self.sizes.audio_mel_bins,
                             self.sizes.audio_frames)

    @cached_property
    def train_data(self) -> ShapesDataset:
        return self._dataset("train")

    @cached_property
    def eval_data(self) -> ShapesDataset:
        return self._dataset("heldout")

    def _build(self, g: ModuleGroups, whole: bool) -> torch.nn.Module:
        """This rank's stage of module `g` (or, with `whole`, the module with pp=1)."""
        if g.layout.role == "llm":
            return build_llm(self.sizes, g.layout.tp, g.pgs, whole=whole, sp=g.layout.sp)
        build = build_vision_encoder if g.layout.name == VISION else build_audio_encoder
        return build(self.sizes, g.layout.tp, g.pgs, whole=whole)

    # ---- pieces the schedules combine ----------------------------------------------------------
    def microbatches(self, batch: GlobalBatch) -> list[GlobalBatch]:
        """Microbatch i: samples d*B/dp + i*M + j for every LLM DP rank d and j < M, in (d, j)
        order, so that LLM DP rank d holds slice d of it; each encoder splits it over its DP ranks."""
        dp, m = self.layout.llm.dp, self.args.micro_batch_size
        per_rank = len(batch.indices) // dp
        return [batch.select([d * per_rank + i + j for d in range(dp) for j in range(m)])
                for i in range(0, per_rank, m)]

    def plan(self, name: str, batch: GlobalBatch) -> RankPlan:
        return self.plans[name].plan(batch.boundaries[name], self.layout_encoders[name], self.layout.llm,
                                     self.rank, self.world_size)

    def _media_tokens(self, name: str) -> int:
        """Rows (tokens) one sample's item of encoder `name` puts into the sequence."""
        return self.sizes.patches_per_image if name == VISION else self.sizes.tokens_per_clip

    def encoder_forward(self, name: str, batch: GlobalBatch, hidden: torch.Tensor | None = None):
        """This rank's stage of encoder `name` on its DP slice of `batch`: the first stage reads the
        images or clips, later ones take `hidden`; the last returns boundary rows in the boundary
        dtype. A frozen encoder runs without a graph."""
        module = self.encoders[name]
        if hidden is None:
            share = module_slice(len(batch.indices), module.layout.dp, module.coords()["dp"])
            hidden = (batch.images if name == VISION else batch.audio)(share).to(self.device)
        with self.timers("encoder-forward"), self.autocast, \
                torch.set_grad_enabled(module.ddp is not None and torch.is_grad_enabled()):
            out = module.net(hidden)
        if not module.net.post_process:
            return out
        rows = out.to(self.boundary_dtype)
        return rows * 0 if self.args.ablate_vision and name == VISION else rows

    def encoder_hidden_like(self, name: str, batch: GlobalBatch) -> torch.Tensor:
        """What encoder `name`'s stages pass each other: [tokens, n_local, encoder hidden] (a vision
        class token included)."""
        module = self.encoders[name]
        hidden = self.sizes.enc_hidden_size if name == VISION else self.sizes.audio_hidden_size
        tokens = self._media_tokens(name) + (self.sizes.vision_arch.class_token if name == VISION else 0)
        n_local = len(batch.indices) // module.layout.dp
        return torch.empty(tokens, n_local, hidden, device=self.device, dtype=self.pipeline_dtype)

    def boundary_like(self) -> torch.Tensor:
        """An empty [0, hidden] tensor of the boundary's dtype and device."""
        return torch.zeros(0, self.sizes.hidden_size, device=self.device, dtype=self.boundary_dtype)

    def _llm_seq_len(self) -> int:
        """Sequence length of this LLM rank's activations (CP-local, and TP-local with SP)."""
        llm = self.layout.llm
        return self.sizes.seq_length // llm.cp // (llm.tp if llm.sp else 1)

    def _llm_local(self, batch: GlobalBatch) -> LLMInputs:
        coords, llm = self.llm.coords(), self.layout.llm
        share = module_slice(len(batch.indices), llm.dp, coords["dp"])
        positions = cp_positions(self.sizes.seq_length, llm.cp, coords["cp"])
        ids, labels, mask = (t[share][:, positions].to(self.device)
                             for t in (batch.input_ids, batch.labels, batch.loss_mask))
        return LLMInputs(ids, positions.to(self.device)[None].expand_as(ids), labels, mask)

    def llm_hidden_like(self, batch: GlobalBatch) -> torch.Tensor:
        b_local = len(batch.indices) // self.layout.llm.dp
        return torch.empty(self._llm_seq_len(), b_local, self.sizes.hidden_size,
                           device=self.device, dtype=self.pipeline_dtype)

    def llm_stage_forward(self, batch: GlobalBatch, media: dict, hidden, with_loss: bool):
        """This rank's LLM stage on its share of `batch`; `media`: encoder name -> boundary slots
        [S' * b_local, h] (first stage). Returns the next stage's input, or on the last stage the sum
        of this rank's token losses (`with_loss`) or the logits."""
        inputs = self._llm_local(batch)
        seq, b_local = self._llm_seq_len(), inputs.input_ids.shape[0]
        views = [(slots.view(seq, b_local, -1), slot_mask(self.plan(name, batch), self.device).view(seq, b_local))
                 for name, slots in media.items()]
        with self.timers("llm-forward"), self.autocast:
            out = llm_forward(self.llm.net, inputs.input_ids, inputs.position_ids, views,
                              inputs.labels if with_loss else None, hidden)
        if with_loss and self.llm.net.post_process:
            return (out.float() * inputs.loss_mask).sum()
        return out

    def finish_step(self, loss_sum: torch.Tensor | None, num_loss_tokens: int) -> float:
        """The global mean token loss; then every module's gradients reduced over its own DP group.
        The loss's reduction over the world is where a rank waits for the slowest one to finish its
        schedule (a pipeline's fill and drain): the clock counts it as waiting."""
        # Every LLM TP rank of the last stage holds the same losses: count one per (dp, cp).
        coords = self.llm.coords()
        counts = coords is not None and coords["tp"] == 0 and coords["pp"] == self.layout.llm.pp - 1
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if counts:
            total += loss_sum
        self.clock.wait([dist.all_reduce(total, async_op=True)])
        for module in self.modules.values():
            if module.ddp is not None:
                module.ddp.finish_grad_sync()
        return total.item() / num_loss_tokens

    def train_step(self, batch: GlobalBatch) -> float:
        """Forward and backward of one global batch; returns the global mean token loss."""
        check_agreement(batch.boundaries, self.device)
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

    def _caption_batch(self, data, indices: list[int], with_captions: bool = True) -> GlobalBatch:
        clip = self.sizes.tokens_per_clip if AUDIO in self.encoders else 0
        return caption_batch(data, indices, self.tokenizer, self.sizes.patches_per_image,
                             self.sizes.seq_length, with_captions, tokens_per_clip=clip)

    def batch(self, step: int) -> GlobalBatch:
        g = self.args.global_batch_size
        return self._caption_batch(self.train_data, list(range(step * g, (step + 1) * g)))

    def zero_grad(self):
        for module in self.modules.values():
            if module.ddp is not None:
                module.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    # ---- evaluation ----------------------------------------------------------------------------
    def _next_tokens(self, logits: torch.Tensor | None, b_local: int) -> torch.Tensor:
        """Greedy tokens [b_local, S] at every position, on every rank of this LLM replica: the last
        stage's argmax over its CP positions, gathered over CP, sent to every stage."""
        llm, coords, pgs = self.layout.llm, self.llm.coords(), self.llm.groups.pgs
        seq = self.sizes.seq_length
        tokens = torch.zeros(b_local, seq, dtype=torch.long, device=self.device)
        if coords["pp"] == llm.pp - 1:
            local = logits[..., : self.tokenizer.vocab_size].argmax(-1)
            gathered = [torch.empty_like(local) for _ in range(llm.cp)]
            dist.all_gather(gathered, local, group=pgs.cp)
            for cp_rank, part in enumerate(gathered):
                tokens[:, cp_positions(seq, llm.cp, cp_rank).to(self.device)] = part
        if llm.pp > 1:
            last = llm.rank_of(tp=coords["tp"], cp=coords["cp"], dp=coords["dp"], pp=llm.pp - 1)
            dist.broadcast(tokens, last, group=pgs.pp)
        return tokens

    @torch.no_grad()
    def generate_captions(self, indices: list[int]) -> list[str]:
        """Greedy captions of held-out images, in index order (on every rank)."""
        batch = self._caption_batch(self.eval_data, indices, with_captions=False)
        check_agreement(batch.boundaries, self.device)
        media = route_media(self, batch)
        mine = []
        coords = self.llm.coords()
        if coords is not None:
            share = module_slice(len(indices), self.layout.llm.dp, coords["dp"])
            prompt = 1 + sum(self._media_tokens(name) for name in self.encoders)
            for t in range(prompt, self.sizes.seq_length):
                stage = LLMStage(self, [batch], None, media={n: [s] for n, s in media.items()})
                run_stage(stage, 1, self.clock)
                tokens = self._next_tokens(stage.logits.get(0), share.stop - share.start)
                batch.input_ids[share, t] = tokens[:, t - 1].cpu()
            if coords["tp"] == coords["cp"] == coords["pp"] == 0:
                mine = [(share.start + i, self.tokenizer.decode(row.tolist()))
                        for i, row in enumerate(batch.input_ids[share])]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        return [caption for _, caption in sorted(sum(gathered, []))]

    def evaluate(self, num_samples: int) -> float:
        indices = list(range(num_samples))
        captions = self.generate_captions(indices)
        return caption_accuracy(captions, [self.eval_data[i] for i in indices])

    def stage_name(self) -> str:
        """What this rank runs, for the waiting report: e.g. 'llm pp1' or 'vision+llm pp0'."""
        held = [(name, m.coords()) for name, m in self.modules.items() if m.coords() is not None]
        return "+".join(name for name, _ in held) + f" pp{held[-1][1]['pp']}"


def log(rank: int, *parts):
    if rank == 0:
        print(*parts, flush=True)


def report_waiting(trainer: Trainer, waiting_s: float, step_s: float) -> None:
    """Print, per rank, the share of step time spent waiting for other ranks' data (pipeline
    bubble and transfers), measured over the steps after the first."""
    shares = [None] * trainer.world_size
    dist.all_gather_object(shares, (trainer.rank, trainer.stage_name(), waiting_s / max(step_s, 1e-9)))
    log(trainer.rank, " waiting share of step time (pipeline bubble + transfers): " + " | ".join(
        f"rank {r} {name}: {100 * share:.1f}%" for r, name, share in shares))


def train(args, layout: HeteroLayout, device: torch.device, on_step=None) -> Trainer:
    """The training loop: logs Megatron-style lines and writes one JSON object per step."""
    trainer = Trainer(args, layout, device)
    rank = trainer.rank
    metrics = None
    if args.metrics_file and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)
        metrics = open(args.metrics_file, "w")
    start = time.perf_counter()
    timed = [0.0, 0.0]  # waiting and step seconds, after the first (warm-up) step
    for step in range(args.train_iters):
        t0, waited = time.perf_counter(), trainer.clock.waiting_s
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
        waiting = trainer.clock.waiting_s - waited
        if step > 0 or args.train_iters == 1:
            timed[0] += waiting
            timed[1] += elapsed
        tokens_per_s = batch.input_ids.numel() / elapsed
        record = dict(step=step + 1, loss=loss, grad_norm=grad_norm, lr=lr, tokens_per_s=tokens_per_s,
                      waiting_share=waiting / elapsed, elapsed_s=time.perf_counter() - start)
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if (step + 1) % args.log_interval == 0:
            log(rank, f" iteration {step + 1:6d}/{args.train_iters:6d} | elapsed time per iteration "
                      f"(ms): {1000 * elapsed:8.1f} | learning rate: {lr:.3E} | lm loss: {loss:.6E} | "
                      f"grad norm: {grad_norm:.3f} | tokens/s: {tokens_per_s:9.1f}")
    report_waiting(trainer, *timed)
    if args.eval_samples:
        accuracy = trainer.evaluate(args.eval_samples)
        log(rank, f" caption accuracy on {args.eval_samples} held-out images: {accuracy:.3f}")
        if metrics:
            metrics.write(json.dumps(dict(caption_accuracy=accuracy, eval_samples=args.eval_samples)) + "\n")
    if metrics:
        metrics.close()
    sys.stdout.flush()
    return trainer
