"""Upstream megatron-core 0.19 MIMO on bench_e2e's workloads, one JSON line per run in bench_e2e's
format (its --report prints both in one table).

    torchrun --nproc-per-node 2 tools/bench_mimo.py --workload W1 --placement colocated \\
        --llm-layers 8 [--warmup 1 --steps 2] [--fp32] --out r.jsonl
    python tools/bench_e2e.py --report r.jsonl

Only the framework differs from bench_e2e on the same 2-GPU layout (colocated: encoder TP1/DP2 and
LLM TP2/DP1 on both ranks, examples/layouts/gpu2_colocated.yaml; non_colocated: encoder on rank 0,
LLM on rank 1, gpu2_non_colocated.yaml; W3 freezes the encoder, the *_frozen.yaml layouts): our
Trainer builds the same modules from the same seeds, their DDP wrappers, the AdamW optimizer clipped
by the global norm (megatron_hetero.training.optimizer), the microbatches and the synthetic batch
(fp32 parameters, bf16 autocast on GPUs). The step is megatron-core's MimoModel over those modules
and the modules' HyperCommGrids, with its text embedding and token merge:
- colocated: its ColocatedBridgeCommunicator (encoder DP2 -> LLM DP1: all-gather forward, narrow
  backward), microbatch by microbatch as megatron-core's forward_backward_no_pipelining does (that
  function is not called: it allocates on "cuda", schedules.py:749);
- non_colocated: its MultiModulePipelineCommunicator (a BridgeCommunicator from the encoder's grid to
  the LLM's) in its 1F1B schedule forward_backward_pipelining_without_interleaving.
After the schedule, our DP reduction and optimizer step, as in bench_e2e.

Phases (second pass, each synchronized; slowest rank), all measured: encoder-forward (the encoder),
llm-forward (text embedding, merge, GPTModel with loss), boundary (colocated: the bridge's forward,
its backward narrow falls in encoder-backward; non_colocated: the communicator's transfers, which
also count as waiting), llm-backward and encoder-backward (colocated: split where the bridged rows'
gradient is ready; non_colocated: each rank's backward between its gradient transfers; 0.0 for a
frozen encoder, which has none), optimizer.
"""

import argparse
import os
import sys
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

# Importing bench_boundary also keeps NVLink multicast off (NCCL_NVLS_ENABLE=0) before NCCL starts.
from bench_boundary import pin_upstream_groups_to_default_backend
# bench_e2e's measurement loop drives the trainer; it moves with the trainer's replacement.
from bench_e2e import measure
from megatron.core.models.mimo import MimoModel, MimoModelConfig, VisionModalitySubmodules
from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY
from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from torch.overrides import TorchFunctionMode

from megatron_hetero.data.batches import VISION, module_slice
from megatron_hetero.planner import BENCH_WORKLOADS
from megatron_hetero.training.bench import run_reporting_errors, trainer_args
from megatron_hetero.training.trainer import Trainer

LAYOUT_DIR = Path(__file__).resolve().parent.parent / "examples" / "layouts"

LAYOUTS = {  # (placement, frozen encoder) -> the layout bench_e2e runs for the same comparison
    ("colocated", False): "gpu2_colocated.yaml",
    ("colocated", True): "gpu2_colocated_frozen.yaml",
    ("non_colocated", False): "gpu2_non_colocated.yaml",
    ("non_colocated", True): "gpu2_non_colocated_frozen.yaml",
}


class _Prebuilt(torch.nn.Module):
    """A ModuleSpec `module` that hands MimoModel a module built beforehand: megatron-core's
    build_module only instantiates classes (spec_utils.py:84 notes the missing case), and our
    modules come from our builders and seeds. `described`: the spec params MimoModel reads."""

    def __new__(cls, module: torch.nn.Module, **described):
        return module


def _timed_forward(timers, name: str, first: torch.nn.Module, last: torch.nn.Module) -> None:
    """Phase `name` from the start of `first`'s forward to the end of `last`'s."""
    phase = ExitStack()
    first.register_forward_pre_hook(lambda *_: phase.enter_context(timers(name)))
    last.register_forward_hook(lambda *_: phase.close())


class TimedMimo(MimoModel):
    """MimoModel with two adaptations, both no-ops for upstream's own bf16-parameter use:
    - its merge (base.py:208, masked_scatter_) needs one dtype, but with fp32 parameters under
      autocast the text embedding is fp32 and the projector's rows bf16: the rows are cast to the
      text dtype after the bridge, as our trainer does (vlm.llm_forward), so the bridge moves bf16;
    - the colocated bridge is timed ("boundary") and its rows' gradient ends llm-backward
      (`backward_phase`: an ExitStack holding the running backward timer)."""

    timers = None
    backward_phase = None

    def align_embeddings_by_token_positions(self, modality_embeddings, input_ids, special_token_ids):
        dtype = modality_embeddings["text"].dtype
        modality_embeddings = {k: v.to(dtype) for k, v in modality_embeddings.items()}
        return super().align_embeddings_by_token_positions(modality_embeddings, input_ids, special_token_ids)

    def _apply_colocated_comms(self, modality_embeddings):
        with self.timers("boundary"):
            bridged = super()._apply_colocated_comms(modality_embeddings)
        for rows in bridged.values():
            if rows.requires_grad:
                rows.register_hook(self._rows_grad_ready)
        return bridged

    def _rows_grad_ready(self, grad):
        self.backward_phase.close()
        self.backward_phase.enter_context(self.timers("encoder-backward"))


class TimedCommunicator(MultiModulePipelineCommunicator):
    """Upstream's multi-module pipeline communicator, timed: its transfers (blocking: each waits for
    the other module's rank) count as phase "boundary" and as waiting, as our pipeline's transfers
    count as waiting. Between receiving a microbatch's output gradients and sending its input's the
    schedule runs only that backward: phase `backward_name` (None: not timed)."""

    trainer = None
    backward_name = None
    backward_phase = None

    def _timed(self, call, *args, **kwargs):
        with self.trainer.timers("boundary"), self.trainer.clock.blocked():
            return call(*args, **kwargs)

    def _grads_in(self, grads):
        if self.backward_name:
            self.backward_phase.enter_context(self.trainer.timers(self.backward_name))
        return grads

    def recv_forward(self, *args, **kwargs):
        return self._timed(super().recv_forward, *args, **kwargs)

    def send_forward(self, *args, **kwargs):
        return self._timed(super().send_forward, *args, **kwargs)

    def send_forward_recv_backward(self, *args, **kwargs):
        return self._grads_in(self._timed(super().send_forward_recv_backward, *args, **kwargs))

    def recv_backward(self, *args, **kwargs):
        return self._grads_in(self._timed(super().recv_backward, *args, **kwargs))

    def send_backward_recv_forward(self, *args, **kwargs):
        self.backward_phase.close()
        return self._timed(super().send_backward_recv_forward, *args, **kwargs)

    def send_backward(self, *args, **kwargs):
        self.backward_phase.close()
        return self._timed(super().send_backward, *args, **kwargs)


class _CudaOnHost(TorchFunctionMode):
    """megatron-core's pipeline schedule allocates on "cuda" by name (schedules.py:2292, its token
    counter): on a host without GPUs (gloo), such tensors go to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class MimoTrainer(Trainer):
    """Our Trainer (modules, DDP, optimizer, microbatches, loss reduction) whose step runs
    megatron-core's MimoModel instead of our schedules and boundary."""

    def __init__(self, args, layout, device):
        super().__init__(args, layout, device)
        if self.device.type != "cuda":
            pin_upstream_groups_to_default_backend()
        vision, llm = self.encoders[VISION], self.llm
        # A rank gets what it holds (non-colocated: one module); an encoder-only rank's MimoModel
        # still reads the LLM spec's config (base.py:54, MegatronModule's and the schedule's config):
        # its own module's stands in.
        here = llm.net if llm.net is not None else vision.net
        encoder_spec = ModuleSpec(module=_Prebuilt, params=dict(module=vision.net))
        self.mimo = TimedMimo(MimoModelConfig(
            language_model_spec=ModuleSpec(module=_Prebuilt, params=dict(module=llm.net, config=here.config)),
            modality_submodules_spec={VISION: ModuleSpec(module=VisionModalitySubmodules,
                                                         submodules={"encoders": {"vit": encoder_spec}})},
            special_token_ids={VISION: self.tokenizer.image_id},
            module_to_grid_map={VISION: vision.groups.grid, MIMO_LANGUAGE_MODULE_KEY: llm.groups.grid},
        ))
        self.mimo.timers = self.timers
        if vision.net is not None:  # MimoModel calls its submodule's forward() directly: no hooks there
            _timed_forward(self.timers, "encoder-forward", vision.net, vision.net)
        if llm.net is not None:
            _timed_forward(self.timers, "llm-forward", llm.net.embedding, llm.net)
        if layout.placement == "non_colocated":
            self._build_pipeline(here.config)

    def _build_pipeline(self, config):
        """Upstream's non-colocated pipeline: a bridge from the encoder's grid to the LLM's (rows
        [s*b, h]) for its 1F1B schedule."""
        # The bridge receives into buffers of the config's pipeline_dtype: the boundary's dtype.
        self.p2p = TimedCommunicator(
            self.mimo.mimo_config.module_to_grid_map, {VISION: [MIMO_LANGUAGE_MODULE_KEY], MIMO_LANGUAGE_MODULE_KEY: []},
            replace(config, pipeline_dtype=self.boundary_dtype), module_output_ndim={VISION: 2})
        # Multi-module schedules need shapes sent with the tensors (schedules.py:2178). Set after
        # construction: TransformerConfig's check against it (transformer_config.py:2648) is for MoE.
        config.variable_seq_lengths = True
        self.p2p.trainer, self.p2p.backward_phase = self, ExitStack()
        if self.llm.net is not None:
            self.p2p.backward_name = "llm-backward"
        elif self.encoders[VISION].ddp is not None:  # a frozen encoder has no backward
            self.p2p.backward_name = "encoder-backward"
        held = {name: m.groups.pgs for name, m in ((VISION, self.encoders[VISION]), (MIMO_LANGUAGE_MODULE_KEY, self.llm))
                if m.net is not None}
        self.pgs = MultiModuleProcessGroupCollection(
            held, MIMO_LANGUAGE_MODULE_KEY if MIMO_LANGUAGE_MODULE_KEY in held else None)

    def _mimo_forward(self, mb, with_llm: bool, with_encoder: bool):
        """MimoModel's forward on this rank's shares of microbatch `mb`: (output, LLM inputs)."""
        vision = self.encoders[VISION]
        inputs = self._llm_local(mb) if with_llm else None
        kwargs = {}
        if with_encoder:
            share = module_slice(len(mb.indices), vision.layout.dp, vision.coords()["dp"])
            kwargs["modality_inputs"] = {VISION: {"vit": {"x": mb.images(share).to(self.device)}}}
            kwargs["input_ids"] = mb.input_ids[share].to(self.device)
        if with_llm:
            kwargs.update(input_ids=inputs.input_ids, position_ids=inputs.position_ids, labels=inputs.labels,
                          loss_mask=inputs.loss_mask)
        with self.autocast:
            output, _ = self.mimo(**kwargs)
        return output, inputs

    def train_step(self, batch) -> float:
        step = self._colocated_step if self.layout.placement == "colocated" else self._non_colocated_step
        return self.finish_step(step(batch), batch.num_loss_tokens)

    def _colocated_step(self, batch) -> torch.Tensor:
        """Microbatch by microbatch: MimoModel forward (encoder on its DP share, bridge, merge, LLM
        on its DP share), summed token losses / global loss tokens, backward. Returns this rank's
        summed token loss."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in self.microbatches(batch):
            token_losses, inputs = self._mimo_forward(mb, with_llm=True, with_encoder=True)
            loss = (token_losses.float() * inputs.loss_mask).sum()
            loss_sum += loss.detach().double()
            with ExitStack() as phase:
                phase.enter_context(self.timers("llm-backward"))
                self.mimo.backward_phase = phase
                (loss / batch.num_loss_tokens).backward()
        return loss_sum

    def _non_colocated_step(self, batch) -> torch.Tensor | None:
        """megatron-core's 1F1B schedule, encoder stage then LLM stage, with our loss (summed token
        losses / global loss tokens; per-token mode, so the schedule does not rescale it). Returns
        this rank's summed token loss (None on the encoder's rank)."""
        micro = self.microbatches(batch)
        on_llm = self.llm.net is not None
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)

        def loss_func(inputs, token_losses):
            loss = (token_losses.float() * inputs.loss_mask).sum()
            loss_sum.add_(loss.detach().double())
            return loss / batch.num_loss_tokens, inputs.loss_mask.sum().int(), {}

        def forward_step(data_iterator, model):
            output, inputs = self._mimo_forward(next(data_iterator), on_llm, not on_llm)
            return output, partial(loss_func, inputs)

        with ExitStack() as host:
            if self.device.type != "cuda":
                host.enter_context(_CudaOnHost())
            forward_backward_pipelining_without_interleaving(
                forward_step_func=forward_step, data_iterator=iter(micro), model=self.mimo,
                num_microbatches=len(micro), seq_length=self.sizes.seq_length,
                micro_batch_size=self.args.micro_batch_size, p2p_communicator=self.p2p, pg_collection=self.pgs)
        return loss_sum if on_llm else None


def run(opts) -> dict:
    from megatron_hetero.layout import load_layout
    from megatron_hetero.training.args import check_args, check_trainable
    from megatron_hetero.training.trainer import init_distributed

    w = BENCH_WORKLOADS[opts.workload]
    w = replace(w, layers=opts.llm_layers or w.layers)
    layout_file = str(LAYOUT_DIR / LAYOUTS[opts.placement, w.frozen])
    owns_process_group = not dist.is_initialized()  # tests start their gloo processes themselves
    device = init_distributed() if owns_process_group else torch.device("cpu")
    world = dist.get_world_size()
    layout = load_layout(layout_file, world)
    args = trainer_args(w, layout_file, not opts.fp32 and device.type == "cuda")
    check_trainable(layout)
    check_args(args, layout)
    trainer = MimoTrainer(args, layout, device)
    record = measure(trainer, w, f"upstream_mimo_{opts.placement}", w.frozen, opts)
    trainer.mimo.destroy()
    if owns_process_group:
        dist.destroy_process_group()
    return record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=list(BENCH_WORKLOADS), default="tiny")
    parser.add_argument("--placement", choices=["colocated", "non_colocated"], default="colocated")
    parser.add_argument("--llm-layers", type=int, default=0, help="shrink the LLM's depth to fit")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fp32", action="store_true", help="fp32 compute (default: bf16 autocast on GPUs)")
    parser.add_argument("--out", default="bench_mimo.jsonl")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", 1)) != 2:
        print("error: run on 2 ranks (torchrun --nproc-per-node 2): the layouts compared are 2-GPU ones",
              file=sys.stderr)
        return 2
    return run_reporting_errors(run, opts)


if __name__ == "__main__":
    sys.exit(main())
