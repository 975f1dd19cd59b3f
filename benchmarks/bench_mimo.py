"""Upstream megatron-core 0.19 MIMO on bench_e2e's workloads, one JSON line per run in bench_e2e's
format (its --report prints both in one table).

    torchrun --nproc-per-node 2 benchmarks/bench_mimo.py --workload W1 --placement colocated \\
        --llm-layers 8 [--warmup 1 --steps 2] [--fp32] --out r.jsonl
    python benchmarks/bench_e2e.py --report r.jsonl

Only the forward-backward function differs from bench_e2e on the same 2-GPU layout (colocated:
encoder TP1/DP2 and LLM TP2/DP1 on both ranks, examples/layouts/gpu2_colocated.yaml; non_colocated:
encoder on rank 0, LLM on rank 1, gpu2_non_colocated.yaml; W3 freezes the encoder, the
*_frozen.yaml layouts). megatron.training is set up as bench_e2e sets it up
(benchmarks/bench.py: the same modules from the same seeds, their DDP wrappers,
megatron-core's optimizer clipped by the global norm, the synthetic global microbatches, bf16
weights on GPUs) and its train_step runs the script's forward step and loss function on
megatron-core's MimoModel over those modules and the modules' HyperCommGrids (its text embedding
and token merge), in upstream's schedules:
- colocated: forward_backward_no_pipelining, MimoModel's ColocatedBridgeCommunicator (encoder DP2
  -> LLM DP1: all-gather forward, narrow backward);
- non_colocated: forward_backward_pipelining_without_interleaving (1F1B) with its
  MultiModulePipelineCommunicator (a BridgeCommunicator from the encoder's grid to the LLM's).
The schedules finalize the gradients as ours do (each module's DP reduction, divided by the global
number of loss tokens), then the optimizer steps.

Phases (second pass, each synchronized; slowest rank), all measured: encoder-forward (the encoder),
llm-forward (text embedding, merge, GPTModel with loss), boundary (colocated: the bridge's forward,
its backward narrow falls in encoder-backward; non_colocated: the communicator's transfers, which
also count as waiting), llm-backward and encoder-backward (the schedule's backward of each
microbatch on the rank holding the module; colocated: split where the bridged rows' gradient is
ready; 0.0 for a frozen encoder, which has none), optimizer.
"""

import argparse
import os
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch
from bench import measure, megatron_trainer, run_reporting_errors
from megatron.core.enums import ModelType
from megatron.core.models.mimo import MimoModel, MimoModelConfig, VisionModalitySubmodules
from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY
from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_without_interleaving,
)
from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec

import megatron_hetero.patches
from megatron_hetero.data.batches import VISION
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.planner import BENCH_WORKLOADS

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
    """MimoModel called as the script's model (the reference model's arguments: one global
    microbatch, families/parts.py), its colocated bridge timed ("boundary"; when the bridged rows'
    gradient is ready, the running backward becomes encoder-backward). `run`: the HeteroRun, whose
    modules say which shares this rank takes (and which finalize_hetero_grads reduces)."""

    run = None
    timers = None
    check_for_nan_in_grad = False  # read by finalize_hetero_grads, as on a HeteroModel

    def forward(self, input_ids, labels, loss_mask, images, vision_counts, vision_positions):
        """MimoModel's forward on this rank's shares: the encoder's DP share of the samples and their
        images (a sample's images in a row: vision_counts), the LLM's DP share of the text (these
        layouts have no CP). MimoModel places the rows by their token ids, which mark
        `vision_positions`."""
        vision, llm = self.run.encoders[VISION], self.run.llm
        kwargs = {}
        if vision.held:
            param = next(vision.part.parameters())
            share = vision.layout.dp_samples(len(input_ids), vision.coords()["dp"])
            first = torch.cat([vision_counts.new_zeros(1), vision_counts.cumsum(0)])  # each sample's first image
            pixels = images[first[share.start] : first[share.stop]].to(param.device, param.dtype)
            kwargs.update(modality_inputs={VISION: {"vit": {"x": pixels}}},
                          input_ids=input_ids[share].to(param.device))
        if llm.held:
            device = next(llm.part.parameters()).device
            share = llm.layout.dp_samples(len(input_ids), llm.coords()["dp"])
            ids = input_ids[share].to(device)
            kwargs.update(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=device).expand_as(ids),
                          labels=labels[share].to(device), loss_mask=loss_mask[share].to(device))
        return super().forward(**kwargs)

    def _apply_colocated_comms(self, modality_embeddings):
        with self.timers("boundary"):
            bridged = super()._apply_colocated_comms(modality_embeddings)
        for rows in bridged.values():
            if rows.requires_grad:
                rows.register_hook(lambda grad: self.timers.switch("encoder-backward"))
        return bridged


class TimedCommunicator(MultiModulePipelineCommunicator):
    """Upstream's multi-module pipeline communicator, timed: its transfers (blocking: each waits for
    the other module's rank) count as phase "boundary" and as waiting, as our pipeline's transfers
    count as waiting. Between receiving a microbatch's output gradients and sending its input's the
    schedule runs only that backward (whose multi-module backward step has no timer): phase
    `backward` (None: not timed)."""

    hetero = None
    backward = None
    backward_running = None

    def _timed(self, call, *args, **kwargs):
        with self.hetero.timers("boundary"), self.hetero.clock.blocked():
            return call(*args, **kwargs)

    def _grads_in(self, grads):
        if self.backward:
            self.backward_running.enter_context(self.hetero.timers(self.backward))
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
        self.backward_running.close()
        return self._timed(super().send_backward_recv_forward, *args, **kwargs)

    def send_backward(self, *args, **kwargs):
        self.backward_running.close()
        return self._timed(super().send_backward, *args, **kwargs)


class _Off:
    """A timer that times nothing."""

    def start(self, barrier=False):
        pass

    def stop(self, barrier=False):
        pass


class _BackwardTimer:
    """config.timers while upstream's schedule runs: the 'backward-compute' timer of its backward
    step (one microbatch's backward) is phase `phase` of our timers (None: not timed); its other
    timers are off."""

    def __init__(self, timers, phase: str | None):
        self.timers, self.phase, self.running = timers, phase, ExitStack()

    def __call__(self, name: str, log_level=None):
        return self if name == "backward-compute" and self.phase else _Off()

    def start(self, barrier=False):
        self.running.enter_context(self.timers(self.phase))

    def stop(self, barrier=False):
        self.running.close()


class UpstreamMimo:
    """megatron-core's MimoModel over a trainer's modules, and a forward-backward function with
    Megatron's signature that runs upstream's schedule for the placement over it."""

    def __init__(self, trainer):
        hetero = trainer.hetero
        run, config = hetero.run, hetero.config
        vision, llm = run.encoders[VISION], run.llm
        # A rank gets what it holds (non-colocated: one module); an encoder-only rank's MimoModel
        # still reads the LLM spec's config (base.py:54, MegatronModule's and the schedule's
        # config): its own module's, the trainer's config, stands in.
        self.mimo = TimedMimo(MimoModelConfig(
            language_model_spec=ModuleSpec(module=_Prebuilt, params=dict(module=llm.part, config=config)),
            modality_submodules_spec={VISION: ModuleSpec(module=VisionModalitySubmodules, submodules={
                "encoders": {"vit": ModuleSpec(module=_Prebuilt, params=dict(module=vision.part))}})},
            special_token_ids={VISION: CaptionTokenizer().image_id},
            module_to_grid_map={VISION: vision.groups.grid, MIMO_LANGUAGE_MODULE_KEY: llm.groups.grid},
        ))
        self.mimo.run, self.mimo.timers = run, hetero.timers  # the schedules' finalize_hetero_grads reads run
        self.mimo.model_type = ModelType.encoder_or_decoder  # as megatron.training's get_model sets it
        if vision.held:  # MimoModel calls its submodule's forward() directly: no hooks there
            _timed_forward(hetero.timers, "encoder-forward", vision.part, vision.part)
        if llm.held:
            _timed_forward(hetero.timers, "llm-forward", llm.part.embedding, llm.part)
        backward = "llm-backward" if llm.held else "encoder-backward" if vision.ddp is not None else None
        colocated = run.layout.placement == "colocated"
        # Upstream's colocated schedule times its backward steps; the multi-module one's backward
        # step has no timer: the communicator times it.
        self.backward_timer = _BackwardTimer(hetero.timers, backward if colocated else None)
        self.p2p = self.pgs = None
        if not colocated:
            self.p2p = TimedCommunicator(
                self.mimo.mimo_config.module_to_grid_map,
                {VISION: [MIMO_LANGUAGE_MODULE_KEY], MIMO_LANGUAGE_MODULE_KEY: []}, config,
                module_output_ndim={VISION: 2})
            self.p2p.hetero, self.p2p.backward, self.p2p.backward_running = hetero, backward, ExitStack()
            # Multi-module schedules need shapes sent with the tensors (schedules.py:2178). Set
            # after construction: TransformerConfig's check against it (transformer_config.py:2648)
            # is for MoE.
            config.variable_seq_lengths = True
            held = {name: m.pgs for name, m in ((VISION, vision), (MIMO_LANGUAGE_MODULE_KEY, llm)) if m.held}
            self.pgs = MultiModuleProcessGroupCollection(
                held, MIMO_LANGUAGE_MODULE_KEY if MIMO_LANGUAGE_MODULE_KEY in held else None)

    def forward_backward(self, *, model, p2p_communicator=None, pg_collection=None, **kwargs):
        """Megatron's forward-backward function (train_step calls it with keywords): upstream's
        schedule over MimoModel instead of `model`, ours."""
        config = self.mimo.config
        megatron_timers, config.timers = config.timers, self.backward_timer
        try:
            if self.p2p is None:
                return forward_backward_no_pipelining(model=self.mimo, pg_collection=self.mimo.run.llm.pgs, **kwargs)
            return forward_backward_pipelining_without_interleaving(
                model=self.mimo, p2p_communicator=self.p2p, pg_collection=self.pgs, **kwargs)
        finally:
            config.timers = megatron_timers

    def destroy(self) -> None:
        self.mimo.destroy()


def run(opts) -> dict:
    w = BENCH_WORKLOADS[opts.workload]
    w = replace(w, layers=opts.llm_layers or w.layers)
    layout_file = str(LAYOUT_DIR / LAYOUTS[opts.placement, w.frozen])
    megatron_hetero.patches.apply()
    with megatron_trainer(w, layout_file, not opts.fp32 and torch.cuda.is_available()) as trainer:
        upstream = UpstreamMimo(trainer)
        record = measure(trainer, w, f"upstream_mimo_{opts.placement}", opts.warmup, opts.steps, opts.out,
                         upstream.forward_backward)
        upstream.destroy()
    return record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=list(BENCH_WORKLOADS), default="tiny")
    parser.add_argument("--placement", choices=["colocated", "non_colocated"], default="colocated")
    parser.add_argument("--llm-layers", type=int, default=0, help="shrink the LLM's depth to fit")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fp32", action="store_true",
                        help="fp32 weights and compute (default on GPUs: Megatron's --bf16, bf16 weights with "
                             "fp32 main params in the optimizer)")
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
