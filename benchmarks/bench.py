"""What the benchmarks (benchmarks/bench_e2e.py, bench_mimo.py) and the planner's check
(tools/check_planner.py) share about training a workload preset: its sizes and flags, its synthetic
batch, megatron.training set up for it as `pretrain()` sets itself up (the reference model of
training/providers.py under our patches), and the timed measurement that makes one JSON line.

A measured step is megatron.training's `train_step` (zero the gradient buffers, the forward-backward
function, the optimizer step, the learning-rate step) on the workload's fixed synthetic global batch;
the forward-backward function is ours (schedules/forward_backward.py) unless a benchmark passes another
with Megatron's signature (bench_mimo: upstream MIMO's schedules).
"""

import collections
import cProfile
import gc
import itertools
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hetero.boundary.transfer import ANNOTATION
from megatron_hetero.cli.checks.common import device_work
from megatron_hetero.cli.plan import gpu_model
from megatron_hetero.data.sample_batch import Media, Sample, SampleBatch
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.models.kinds import ENCODER_KINDS
from megatron_hetero.planner import Calibration, Cluster, model_flops, plan
from megatron_hetero.planner.candidates import micro_batches
from megatron_hetero.planner.presets import (
    FAMILY_BENCHES,
    BenchWorkload,
    resized_workload,
    trainer_vocab_size,
    trainer_workload,
)
from megatron_hetero.runtime.timers import PHASES
from megatron_hetero.schedules.step import first_stage_inputs
from megatron_hetero.spec.layout import LayoutError
from megatron_hetero.spec.sizes import ModelSizes, sizes_to_dict
from megatron_hetero.training.args import ArgsError, parse_script_args

# Steps of the synchronized breakdown pass (after the free-running ones): phases vary little.
PHASE_STEPS = 3
# Back-to-back replays of a step's encoder work in the encoders-alone pass (each a whole step's).
ALONE_REPEATS = 3
# Megatron's --bf16: bf16 weights, fp32 main params and Adam in megatron-core's optimizer (the
# records before the move to megatron.training kept fp32 weights under bf16 autocast).
PRECISION = {True: "bf16 weights, fp32 main params (megatron-core optimizer)", False: "fp32"}


def sized_workload(w: BenchWorkload, layout, llm_layers: int = 0, global_batch: int = 0,
                   micro_batch: int | None = None, **sizes) -> BenchWorkload:
    """The workload with the LLM depth and global batch overridden (0: the workload's), micro
    batch `micro_batch` (None: the workload's; 0: the smallest the layout accepts: micro batch x
    LLM DP divides the global batch) and `sizes` (presets.resized_workload's: sequence length,
    images per sample, image size; a bad one is one line)."""
    try:
        w = resized_workload(w, **sizes)
    except ValueError as error:
        raise ArgsError(str(error)) from None
    w = replace(w, layers=llm_layers or w.layers, global_batch=global_batch or w.global_batch)
    if micro_batch == 0:
        sizes = micro_batches(replace(trainer_workload(w, 1, False), micro_batch=0), (*layout.encoders, layout.llm))
        if not sizes:
            raise ArgsError(f"--global-batch {w.global_batch}: no micro batch size splits it over the LLM's DP "
                            f"{layout.llm.dp}; use a multiple of {layout.llm.dp}")
        micro_batch = sizes[0]
    return replace(w, micro_batch=micro_batch or w.micro_batch)


def family_sizes(w: BenchWorkload) -> ModelSizes:
    """A VLM family workload's model sizes (its Hugging Face config, the LLM at depth w.layers); a
    depth the model cannot have (Qwen3-VL's DeepStack rows need an LLM layer each) is one line."""
    from transformers import AutoConfig

    from megatron_hetero.convert.rules import HFMappingError
    from megatron_hetero.families import family_named

    bench = FAMILY_BENCHES[w.name]
    try:
        sizes = family_named(w.family).sizes(AutoConfig.for_model(bench.model_type, **bench.hf_config(w.layers)))
    except HFMappingError as error:
        raise ArgsError(f"--llm-layers {w.layers}: {error}") from None
    return replace(sizes, seq_length=w.seq_length)


def _family_model_file(w: BenchWorkload) -> str:
    """A model.json (sizes only: the bench trains on synthetic batches) of a family workload."""
    handle, path = tempfile.mkstemp(prefix=f"{w.name}_", suffix=".json")
    with os.fdopen(handle, "w") as f:
        json.dump({"sizes": sizes_to_dict(family_sizes(w))}, f)
    return path


def workload_flags(w: BenchWorkload, layout_file: str, bf16: bool) -> list[str]:
    """examples/pretrain_vlm.py's flags (Megatron's and its own) that train the workload under the
    layout file; `bf16`: Megatron's --bf16. A family's model comes from a model.json (--model-sizes),
    its batches are the benchmark's own (--mock-data)."""
    if w.family:
        return ["--hetero-layout", layout_file, "--global-batch-size", str(w.global_batch), "--micro-batch-size",
                str(w.micro_batch), "--model-sizes", _family_model_file(w), "--seq-length", str(w.seq_length),
                "--mock-data", *(["--bf16"] if bf16 else [])]
    flags = ["--hetero-layout", layout_file, "--global-batch-size", str(w.global_batch),
             "--micro-batch-size", str(w.micro_batch), "--image-size", str(w.image_size),
             "--patch-size", str(w.patch_size), "--enc-hidden-size", str(w.enc_hidden),
             "--enc-num-layers", str(w.enc_layers), "--enc-num-attention-heads", str(w.enc_heads),
             "--hidden-size", str(w.hidden), "--num-layers", str(w.layers),
             "--num-attention-heads", str(w.heads), "--seq-length", str(w.seq_length),
             "--images-per-sample", str(w.images_per_sample)]
    return flags + (["--bf16"] if bf16 else [])


def workload_args(w: BenchWorkload, layout_file: str, bf16: bool):
    """The script's flags for the workload, parsed but not validated (what check_args checks)."""
    return parse_script_args(workload_flags(w, layout_file, bf16), validate=False)


class _BenchTokenizer:
    """The special tokens a family's image tags need (FamilyBench.tokens), as a tokenizer answers
    them: the benchmark's batches have no tokenizer of their own."""

    def __init__(self, ids: dict, name: str):
        self.ids, self.directory = ids, f"the {name} preset"

    def token_id(self, token: str) -> int | None:
        return self.ids.get(token)


def _family_items(w: BenchWorkload, media) -> tuple[list, list]:
    """(vision items, audio items) of a sample as the family's processing makes them from the sizes
    alone: its images, then its videos, each with its own audio track where the family loads it (the
    video's tag holds both; the track is an item of the audio encoder)."""
    from megatron_hetero.data.audio import AudioInfo
    from megatron_hetero.data.video import VideoInfo

    vision, audios = [media.items(width, height) for width, height in w.image_sizes], []
    for width, height, seconds, fps in w.video_sizes:
        video = media.video_items(VideoInfo(round(seconds * fps), fps, width, height))
        if getattr(media, "load_audio_from_video", False):
            audios.append(media.audio_items(AudioInfo(round(seconds * media.extractor.sampling_rate))))
            video = media.with_audio(video, audios[-1])
        vision.append(video)
    return vision, audios


def _expanded(items: list, tokens) -> list[int]:
    """The token ids the items' tags expand to, one after another (an item's own expansion where it
    has one: a video's, with its audio's placeholders interleaved)."""
    ids = []
    for item in items:
        if item.expansion is None:
            ids += [*tokens.prefix, *[tokens.placeholder] * sum(item.rows), *tokens.suffix]
        elif len(item.expansion) == 1 and isinstance(item.expansion[0], tuple):
            ids += item.expansion[0]
        else:
            raise ValueError("the bench's batches take no media whose tag expands to text (Qwen3-VL's videos)")
    return ids


def family_batch(w: BenchWorkload, seed: int = 0) -> list[Sample]:
    """A family workload's global batch: every sample with the workload's images and videos (random
    patches; an omni family's audio tracks, random features), their tags expanded as the family's
    data does after the first token, then random text carrying the loss."""
    from transformers import AutoConfig

    from megatron_hetero.families import family_named

    bench, sizes = FAMILY_BENCHES[w.name], family_sizes(w)
    media = family_named(w.family).media(sizes, bench.processor,
                                         AutoConfig.for_model(bench.model_type, **bench.hf_config()).to_dict())
    tokens = media.tokens(_BenchTokenizer(bench.tokens, w.name))
    audio_tokens = getattr(media, "audio_tokens", None)
    vision, audios = _family_items(w, media)
    expanded = torch.tensor(_expanded(vision, tokens), dtype=torch.long)
    if 1 + len(expanded) >= w.seq_length:
        raise ValueError(f"{w.name}: {len(expanded)} image and video tokens do not fit a {w.seq_length}-token sequence")
    text_below = min(*tokens.prefix, *tokens.placeholders, *tokens.suffix,
                     *((audio_tokens.placeholder, *audio_tokens.prefix) if audio_tokens else ()))
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(w.global_batch):
        ids = torch.randint(0, text_below, (w.seq_length,), generator=g)  # text below the special tokens' ids
        ids[1 : 1 + len(expanded)] = expanded
        kinds = {"vision": media.media(vision, torch.nonzero(torch.isin(ids, torch.tensor(tokens.placeholders)))[:, 0])}
        if audios:
            kinds["audio"] = media.audio_media(audios, torch.nonzero(ids == audio_tokens.placeholder)[:, 0])
        for m in kinds.values():
            m.items = torch.rand(m.items.shape, generator=g)
        loss_mask = torch.zeros(w.seq_length)
        loss_mask[1 + len(expanded) : w.seq_length - 1] = 1.0
        at = kinds["vision"].positions.tolist()
        runs = [t for k, t in enumerate(at) if not k or at[k - 1] != t - 1]  # each run of placeholders' start
        samples.append(Sample(ids, torch.roll(ids, -1), loss_mask, kinds,
                              position_ids=media.position_ids(w.seq_length, runs, vision)))
    return samples


def synthetic_batch(w: BenchWorkload, tokenizer, seed: int = 0) -> list[Sample]:
    """A global batch of the workload's shapes (data/sample_batch.py): in each sequence its k images'
    tokens first, then random text, the text positions carrying the loss."""
    g = torch.Generator().manual_seed(seed)
    b, s, k, rows = w.global_batch, w.seq_length, w.images_per_sample, w.images_per_sample * w.tokens_per_image
    if 1 + rows >= s:
        raise ValueError(f"{w.name}: {rows} image tokens do not fit a {s}-token sequence")
    ids = torch.randint(tokenizer.image_id + 1, tokenizer.vocab_size, (b, s), generator=g)
    ids[:, 0], ids[:, 1 : 1 + rows] = tokenizer.bos_id, tokenizer.image_id
    loss_mask = torch.zeros(b, s)
    loss_mask[:, rows : s - 1] = 1.0
    images = torch.rand(b, k, 3, w.image_size, w.image_size, generator=g)
    labels = torch.roll(ids, -1, dims=1)
    return [Sample(ids[i], labels[i], loss_mask[i],
                   {"vision": Media(images[i], torch.tensor([k]), torch.arange(1, 1 + rows))}) for i in range(b)]


def global_microbatches(samples: list[Sample], size: int) -> list[dict]:
    """The model call's arguments of the global microbatches of `samples` in order, `size` samples
    each (micro batch x LLM DP), as every rank's loader yields them under --hetero-layout
    (patches/hetero_data.py)."""
    keys = {kind.name: kind.input_key for kind in ENCODER_KINDS.values()}
    return [SampleBatch.collate(samples[i : i + size]).model_kwargs(keys) for i in range(0, len(samples), size)]


@dataclass
class Trainer:
    """megatron.training set up for one workload: the model (one HeteroModel chunk), its optimizer
    (megatron-core's MimoOptimizer, whose step counts as phase "optimizer"), the learning-rate
    scheduler, and the workload's global microbatches, over and over; setup_s: the seconds
    setup_model_and_optimizer took (the model's build and initialization, DDP, the optimizer)."""

    args: object
    model: list
    optimizer: object
    scheduler: object
    batches: object
    setup_s: float = 0.0
    iteration: int = 0  # steps taken

    @property
    def hetero(self):
        return self.model[0]

    def train_step(self, forward_backward_func=None) -> dict:
        """megatron.training's train_step on the next global batch; its loss report (empty off the
        LLM's last stage)."""
        from megatron.training.training import train_step

        from megatron_hetero.schedules.forward_backward import forward_backward
        from megatron_hetero.training.providers import forward_step

        loss, *_ = train_step(forward_step, self.batches, self.model, self.optimizer, self.scheduler,
                              self.hetero.config, forward_backward_func or forward_backward)
        self.iteration += 1
        # --manual-gc as megatron.training's loop runs it: a full collection every interval steps.
        if self.args.manual_gc and self.args.manual_gc_interval and self.iteration % self.args.manual_gc_interval == 0:
            gc.collect()
        return loss


class GcTime:
    """Python's garbage collections while inside (gc.callbacks): per generation, how many ran and the
    seconds they held the host. A full collection walks every tracked object (over 5 x 10^5 once torch,
    megatron-core and this package are imported); the GPU idles for it wherever the host is not ahead."""

    def __enter__(self):
        self.counts, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], None
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self._start = None


class _TimedStep:
    """An optimizer whose step counts as phase "optimizer" (train_step calls it inside)."""

    def __init__(self, optimizer, timers):
        self.optimizer, self.timers = optimizer, timers

    def step(self):
        with self.timers("optimizer"):
            return self.optimizer.step()

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


def planner_answer(preset: BenchWorkload, world_size: int, gpu_memory_gb: float, gpu: str = "h200") -> str:
    """The planner's best layout that fits for a preset workload (bench_e2e's): its run's further
    advice out of GPU memory (runtime/failures.py), with the calibration measured on `gpu` (a GPU model
    of `plan`'s, whose calibration `plan --gpu` takes)."""
    # With the memory-saving flags the line also names (recomputation, the distributed optimizer):
    # without them the planner answered "none fits" where a recomputed layout fits (W6 on an H100).
    workload = replace(trainer_workload(preset, trainer_vocab_size(preset), preset.frozen),
                       distributed_optimizer=True, allow_recompute=True)
    best = plan(workload, Cluster(world_size, gpu_memory_gb), Calibration.measured(gpu)).best()
    # The workload the run built (--as-trained; bench_e2e's depth and batch sizes), so that the command
    # gives the same answer.
    command = (f"megatron-hetero plan --workload {preset.name} --as-trained --llm-layers {preset.layers} "
               f"--global-batch-size {preset.global_batch} --micro-batch-size {preset.micro_batch} "
               f"--gpus {world_size} --gpu-memory-gb {round(gpu_memory_gb, 2):g} --distributed-optimizer "
               f"--allow-recompute --gpu {gpu}")
    gpus = f"{world_size} GPU{'s' if world_size > 1 else ''}"
    if best is None:
        return f"the planner finds no layout of {preset.name} that fits {gpus} of {gpu_memory_gb:.0f} GB ({command})"
    return (f"the planner's best for {preset.name} on {gpus}: {best.candidate.placement} "
            f"{best.candidate.describe()}, micro batch {best.candidate.micro_batch}, "
            f"{best.memory_gb:.0f} GB/GPU predicted ({command} --write-yaml best.yaml)")


def _gpu_model() -> str:
    """This GPU's model among `plan`'s (h200 without a GPU or for a model it has no calibration of)."""
    return (gpu_model(torch.cuda.get_device_name()) if torch.cuda.is_available() else None) or "h200"


def _gpu_memory_gb() -> float:
    """This GPU's capacity in GB (80 without one)."""
    if not torch.cuda.is_available():
        return 80.0
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 1e9


@contextmanager
def megatron_trainer(w: BenchWorkload, layout_file: str, bf16: bool, extra_flags=()):
    """megatron.training initialized for the workload as pretrain() initializes itself (the caller has
    applied megatron_hetero.patches, as a script does; the script's validated arguments,
    initialize_megatron, JIT options, setup_model_and_optimizer with the reference model's provider,
    then what train() sets before its first step), yielding a Trainer; megatron.training's globals
    are unset afterwards, so that a process can hold several trainers in turn. The process group is
    started here unless it is already (then it is left running). The learning rate is 1e-5,
    constant: the steps are timed, not trained. `extra_flags`: further flags of the script."""
    from megatron.core.enums import ModelType
    from megatron.core.parallel_state import destroy_model_parallel
    from megatron.core.rerun_state_machine import RerunDataIterator, destroy_rerun_state_machine
    from megatron.training.global_vars import get_timers, unset_global_variables
    from megatron.training.initialize import set_jit_fusion_options
    from megatron.training.training import initialize_megatron, setup_model_and_optimizer

    from megatron_hetero.parallel.groups import init_distributed
    from megatron_hetero.training.providers import model_provider

    owns_process_group = not dist.is_initialized()
    if owns_process_group:  # megatron.training then takes the process group as it is
        init_distributed()
    timed = ["--train-iters", "1000000", "--lr", "1e-5", "--lr-decay-style", "constant"]
    args = parse_script_args(workload_flags(w, layout_file, bf16) + timed + list(extra_flags))
    try:
        initialize_megatron()
        run = args.hetero_run  # out of GPU memory, its line adds the planner's answer for the workload
        run.handles.memory_advice = lambda: planner_answer(w, run.layout.world_size, _gpu_memory_gb(), _gpu_model())
        set_jit_fusion_options(tp_size=args.tensor_model_parallel_size)
        started = time.perf_counter()
        model, optimizer, scheduler = setup_model_and_optimizer(ModelType.encoder_or_decoder,
                                                                model_provider_func=model_provider)
        setup_s = time.perf_counter() - started
        hetero = model[0]
        hetero.train()
        hetero.config.grad_scale_func = optimizer.scale_loss
        hetero.config.timers = get_timers()
        batch = family_batch(w) if w.family else synthetic_batch(w, CaptionTokenizer())
        micro = global_microbatches(batch, w.micro_batch * hetero.run.layout.llm.dp)
        if torch.cuda.is_available():  # as megatron.training's loader (pin_memory=True) yields them
            micro = [{k: v.pin_memory() if torch.is_tensor(v) else v for k, v in m.items()} for m in micro]
        if args.manual_gc:  # as train() begins under --manual-gc: the automatic collector off
            gc.disable()
            gc.collect()
        yield Trainer(args, model, _TimedStep(optimizer, hetero.timers), scheduler,
                      RerunDataIterator(itertools.cycle(micro)), setup_s)
    finally:
        gc.enable()
        destroy_rerun_state_machine()
        destroy_model_parallel()
        unset_global_variables()
        if owns_process_group:
            dist.destroy_process_group()


def _stage_name(run) -> str:
    """What this rank runs, for the per-rank records: e.g. 'llm pp1' or 'vision+llm pp0'."""
    held = [m for m in run.modules.values() if m.held]
    return "+".join(m.name for m in held) + f" pp{held[-1].coords()['pp']}"


class _BackwardPhases:
    """The model's adapter, marking where one backward moves between modules (colocated, LLM
    pp=1: one autograd graph through the LLM, the boundary and the encoders): when the gradient of
    the boundary's slots is ready the LLM's backward is done, when an encoder's rows' is ready the
    boundary's is and that encoder's begins (autograd's order, whichever encoder it takes first)."""

    def __init__(self, adapter, timers):
        self.adapter, self.timers = adapter, timers

    def __getattr__(self, name):
        return getattr(self.adapter, name)

    def _switch_at_grad(self, tensor, phase: str, module: str | None = None) -> None:
        if self.timers.enabled and tensor.requires_grad:
            tensor.register_hook(lambda grad: self.timers.switch(phase, module))

    def encoder_forward(self, module, share, x):
        rows = self.adapter.encoder_forward(module, share, x)
        if module.last_stage:
            self._switch_at_grad(rows, "encoder-backward", module.name)
        return rows

    def llm_forward(self, module, call, share, media, hidden):
        for m in media.values():
            if m.rows.grad_fn is not None:  # exchanged in this graph, not received as a leaf
                self._switch_at_grad(m.rows, "boundary")
        return self.adapter.llm_forward(module, call, share, media, hidden)


class _EncoderCalls:
    """The model's adapter, keeping the calls of the encoders' forward a step makes (module, share)
    where one call is the whole encoder (unpipelined) and it is the forward that is trained (a
    trainable encoder's, with autograd on; not the colocated recompute schedule's first pass without
    a graph) or the frozen encoder's: what encoders_alone replays."""

    def __init__(self, adapter):
        self.adapter, self.calls = adapter, []

    def __getattr__(self, name):
        return getattr(self.adapter, name)

    def encoder_forward(self, module, share, x):
        if module.first_stage and module.last_stage and (torch.is_grad_enabled() or module.ddp is None):
            self.calls.append((module, share))
        return self.adapter.encoder_forward(module, share, x)


def encoders_alone(trainer: Trainer, forward_backward_func, repeats: int = ALONE_REPEATS) -> dict[str, float]:
    """Seconds per step of each unpipelined encoder on this rank by itself: one training step's calls
    of its forward (captured) replayed `repeats` times back to back, each followed by its backward
    from a gradient of ones (a frozen encoder: forward only), the GPU synchronized only before and
    after, so that the host runs ahead as in a free-running step. What the step's synchronized phases
    cannot give: there each phase starts on an idle GPU, and an encoder's forward, the first work of
    a microbatch, is timed with the host's launches. The gradients land in the modules' buffers under
    DDP's no_sync (no reduction: a step's last backward reduces them), from zero, and are zeroed after."""
    hetero = trainer.hetero
    adapter = hetero.adapter
    hetero.adapter = capture = _EncoderCalls(adapter)
    try:
        _steps(trainer, 1, forward_backward_func)
    finally:
        hetero.adapter = adapter
    seconds = {}
    for name in dict.fromkeys(module.name for module, _ in capture.calls):
        module = hetero.run.modules[name]
        shares = [share for m, share in capture.calls if m.name == name] * repeats
        trainable = module.ddp is not None
        _zero_grads(trainer)
        with module.ddp.no_sync() if trainable else nullcontext():
            seconds[name] = _timed(lambda: _encoder_passes(adapter, module, shares, trainable), barrier=False) / repeats
    _zero_grads(trainer)
    return seconds


def _zero_grads(trainer: Trainer) -> None:
    """As train_step begins: the gradient buffers zeroed and the parameters' .grad unset (after an
    fp32 optimizer's step .grad is a view of the buffer, into which autograd would add)."""
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()


def _encoder_passes(adapter, module, shares: list, trainable: bool) -> None:
    for share in shares:
        with torch.set_grad_enabled(trainable):
            rows = adapter.encoder_forward(module, share, first_stage_inputs(adapter, module, share))
        if trainable:
            rows.backward(torch.ones_like(rows))


def _steps(trainer: Trainer, n: int, forward_backward_func, losses: list | None = None) -> list[float]:
    """Seconds of each of n training steps (the GPU synchronized at each step's end: the host runs
    ahead by at most one step's launches, which the next synchronization absorbs); each step's
    loss appended to `losses` on the LLM's last stage (read after the synchronization)."""
    from megatron_hetero.training.providers import LOSS_KEY

    times = []
    for _ in range(n):
        start = time.perf_counter()
        loss = trainer.train_step(forward_backward_func)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if losses is not None and loss:
            losses.append(float(loss[LOSS_KEY]))
    return times


def measure(trainer: Trainer, w: BenchWorkload, layout_name: str, warmup: int, steps: int, out: str,
            forward_backward_func=None, memory_cap_gib: float | None = None) -> dict:
    """Train the workload's batch: `warmup` steps, `steps` timed one by one (their spread and peak
    memory in the record), each encoder alone (encoders_alone), then PHASE_STEPS with the phase timers
    on (each phase's median over them); returns the record (rank 0 also appends it to `out` and prints
    it). memory_cap_gib: the allocator's cap the caller set, recorded."""
    hetero, world = trainer.hetero, dist.get_world_size()
    run, cuda = hetero.run, torch.cuda.is_available()
    losses: list[float] = []  # every step's, from the first: a change that keeps the values keeps these
    _steps(trainer, warmup, forward_backward_func, losses)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    waited = hetero.clock.waiting_s
    with GcTime() as collected:
        step_times = _steps(trainer, steps, forward_backward_func, losses)
    step_s = sum(step_times) / len(step_times)
    waiting_s = (hetero.clock.waiting_s - waited) / steps
    peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    alone = encoders_alone(trainer, forward_backward_func)
    hetero.adapter = _BackwardPhases(hetero.adapter, hetero.timers)
    hetero.timers.enabled = True  # the breakdown pass: phases synchronized
    each, each_module, order = [], [], []
    for _ in range(min(steps, PHASE_STEPS)):
        _steps(trainer, 1, forward_backward_func)
        order = order or work_order(hetero.timers.opened)
        each.append(dict(hetero.timers.seconds))
        each_module.append(module_phases(hetero.timers.spans, 1))
        hetero.timers.reset()
    phases = median_phases(each)
    modules = dict.fromkeys(m for step in each_module for m in step)
    by_module = {m: median_phases([step.get(m, {}) for step in each_module]) for m in modules}
    frozen = any(m.freeze for m in run.layout.encoders)
    flops = model_flops(w, trainer_vocab_size(w), frozen)
    from megatron_hetero.models.specs import KERNEL_KINDS, kernel_summaries  # imports megatron-core

    kernels = {m.name: kernel_summaries(m.part) for m in run.modules.values() if m.held}
    mine = dict(rank=run.rank, stage=_stage_name(run), setup_s=trainer.setup_s, peak_gb=peak_gb,
                outside_allocator_gib=_outside_allocator_gib(),
                waiting_s=waiting_s, gc_collections=collected.counts, gc_s=sum(collected.seconds),
                phases=phases, module_phases=by_module, work_order=order, encoders_alone=alone,
                **{kind: {name: summaries[kind] for name, summaries in kernels.items()} for kind in KERNEL_KINDS},
                losses=losses)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    bf16 = trainer.args.bf16
    record = dict(
        workload=w.name, layout=layout_name, gpus=world, llm_layers=w.layers, global_batch=w.global_batch,
        micro_batch=w.micro_batch, seq_length=w.seq_length, items_per_sample=w.images_per_sample,
        **({} if w.family else {"image_size": w.image_size}),
        step_s=step_s, step_s_min=min(step_times), step_s_max=max(step_times), steps=len(step_times),
        tokens_per_s=w.global_batch * w.seq_length / step_s,
        tflops_per_gpu=sum(flops.values()) / step_s / world / 1e12,
        encoder_flops_share=1 - flops["llm"] / sum(flops.values()),
        module_tflops={name: f / 1e12 for name, f in flops.items()},
        peak_gb_max=max(r["peak_gb"] for r in gathered),
        setup_s_max=max(r["setup_s"] for r in gathered),
        outside_allocator_gib_max=max(r["outside_allocator_gib"] for r in gathered),
        waiting_share_max=max(r["waiting_s"] for r in gathered) / step_s,
        # Python's collections in the timed steps (GcTime): the most of any rank, per generation and
        # the host's seconds per step.
        gc_collections_max=[max(r["gc_collections"][g] for r in gathered) for g in range(3)],
        gc_s_per_step_max=max(r["gc_s"] for r in gathered) / len(step_times),
        phases={p: max(r["phases"].get(p, 0.0) for r in gathered) for p in PHASES}, ranks=gathered,
        module_phases=_slowest_module_phases([r["module_phases"] for r in gathered]),
        work_orders=_work_orders(gathered), encoders_alone=_slowest_alone([r["encoders_alone"] for r in gathered]),
        **{kind: _kernels_by_module(gathered, kind) for kind in KERNEL_KINDS},
        losses=next((r["losses"] for r in gathered if r["losses"]), []),
        date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__, bf16=bf16, precision=PRECISION[bf16],
    )
    if cuda:  # what the planner's check judges this run's memory against (tools/planner_fit.py: record_memory_gb)
        record["device_memory_gib"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    if memory_cap_gib:
        record["memory_cap_gib"] = memory_cap_gib
    if run.rank == 0:
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps({k: v for k, v in record.items() if k != "ranks"}))
    return record


def median_phases(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median seconds over steps (phase -> seconds per step; a phase a step lacks: 0):
    one slow step of the few the timers run (a recompilation, a stall) does not move it."""
    names = dict.fromkeys(name for step in steps for name in step)
    return {name: statistics.median(step.get(name, 0.0) for step in steps) for name in names}


def module_phases(spans: list, steps: int) -> dict[str, dict[str, float]]:
    """Seconds per step of each module's phases (its forward, backward; an encoder's in the
    encoder-* phases) from the phase timers' spans of `steps` steps."""
    out: dict[str, dict[str, float]] = {}
    for phase, module, start, end in spans:
        if module is not None:
            mine = out.setdefault(module, {})
            mine[phase] = mine.get(phase, 0.0) + (end - start) / steps
    return out


def _work_orders(ranks: list[dict]) -> dict[str, list[str]]:
    """Each distinct order of the work in a step -> under the ranks that ran it ("0-3", "0,2")."""
    held: dict[tuple, list[int]] = {}
    for r in ranks:
        held.setdefault(tuple(r["work_order"]), []).append(r["rank"])
    return {_ranks(ids): list(order) for order, ids in held.items()}


def _ranks(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)) else \
        ",".join(map(str, ids))


def _slowest_module_phases(ranks: list[dict]) -> dict[str, dict[str, float]]:
    """Each module's phase seconds on its slowest rank (module_phases of every rank)."""
    out: dict[str, dict[str, float]] = {}
    for mine in ranks:
        for module, phases in mine.items():
            for phase, seconds in phases.items():
                out.setdefault(module, {})[phase] = max(out.get(module, {}).get(phase, 0.0), seconds)
    return out


def _kernels_by_module(ranks: list[dict], kind: str) -> dict[str, str]:
    """Each module's kernels of `kind` as its ranks report them (kernel_summaries); a stage without
    that kind of layer ("none": the loss before the LLM's last stage) does not hide another's."""
    merged = {}
    for r in ranks:
        for name, kernel in r[kind].items():
            if kernel != "none" or name not in merged:
                merged[name] = kernel
    return merged


def _slowest_alone(ranks: list[dict]) -> dict[str, dict]:
    """Each encoder's seconds alone on its slowest rank and the number of ranks that ran it."""
    names = dict.fromkeys(name for mine in ranks for name in mine)
    return {name: dict(seconds=max(mine[name] for mine in ranks if name in mine),
                       gpus=sum(name in mine for mine in ranks)) for name in names}


def work_order(opened: list) -> list[str]:
    """The order of the modules' work in a step as this rank ran it, from the phases as they opened
    (PhaseTimers.opened): "vision forward", "audio forward", "llm forward", "llm backward", ... (the
    boundary's exchanges, of no one module, left out)."""
    return [f"{module} {phase.rpartition('-')[2]}" for phase, module in opened if module is not None]


def _outside_allocator_gib() -> float:
    """What this process holds on its GPU outside PyTorch's allocator (NCCL's buffers, the CUDA
    context, workspaces), in GiB: what an allocator cap (--gpu-memory-gib) does not see; 0 on CPUs."""
    if not torch.cuda.is_available():
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**30


# Kernel families of a profile, by name (the first that matches): where a step's GPU time goes.
# Attention and normalization before matmul: flash-attn-4's and quack's kernels, compiled by
# CUTLASS's CuTe DSL, carry "cutlass" too.
KERNEL_FAMILIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("normalization", ("norm",)),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
    ("communication", ("nccl",)),
    ("softmax / cross entropy", ("softmax", "cross_entropy", "log_softmax", "nll")),
    ("elementwise / copies", ("elementwise", "vectorized", "unrolled", "copy", "fill", "cat", "index", "where",
                              "reduce", "gelu", "silu", "mul", "add")),
)


def kernel_family(name: str) -> str:
    lower = name.lower()
    return next((family for family, keys in KERNEL_FAMILIES if any(k in lower for k in keys)), "other")


def profile_step(trainer: Trainer, path: str, forward_backward_func=None, trace: str | None = None) -> dict:
    """One more training step under torch.profiler (CUDA kernels): this rank's GPU kernel time by
    family against the step's wall time (the rest: the GPU idle, waiting on the host or on other
    ranks), the 25 costliest kernels and the idle gaps by launching op (idle_lines), written to `path`
    (rank 0) with, from one step more, the matmuls by shape (matmul_lines) and the host's waits
    (host_syncs), from one more, the Python functions the host spent longest in (python_lines; all of
    them in PATH.pstats); with `trace`, rank 0's whole timeline as a Chrome trace there too. Returns the
    summary."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        trainer.train_step(forward_backward_func)
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    kernels = device_work(prof.key_averages())
    families: dict[str, float] = {}
    for e in kernels:
        family = kernel_family(e.key)
        families[family] = families.get(family, 0.0) + e.self_device_time_total / 1e6
    busy_s = sum(families.values())
    summary = dict(wall_s=wall_s, kernel_s=busy_s, idle_s=max(wall_s - busy_s, 0.0),
                   families={k: families[k] for k in sorted(families, key=families.get, reverse=True)})
    # One step more for what costs host time, which would skew the idle time above: the host's waits
    # and the input shapes and FLOPs of the matmuls (their kernels' times stay as they are).
    with profile(activities=activities, record_shapes=True, with_flops=True) as shapes:
        syncs = host_syncs(trainer, forward_backward_func)
    python = python_profile(trainer, forward_backward_func)
    if dist.get_rank() == 0:
        matmuls = matmul_lines(shapes.key_averages(group_by_input_shape=True), matmul_calls(shapes.events()))
        lines = (_profile_lines(prof, kernels, summary) + idle_lines(prof.events()) + matmuls
                 + op_lines(shapes.events()) + python_lines(python))
        Path(path).write_text("\n".join(lines + _sync_lines(syncs)) + "\n")
        python.dump_stats(Path(path).with_suffix(".pstats"))  # every function, for pstats' own queries
        if trace:
            prof.export_chrome_trace(trace)
        print(json.dumps(dict(profile=path, **summary)))
    return summary


def python_profile(trainer: Trainer, forward_backward_func=None) -> pstats.Stats:
    """One more training step under Python's profiler (cProfile), to its GPU's end."""
    torch.cuda.synchronize()
    with cProfile.Profile() as host:
        trainer.train_step(forward_backward_func)
        torch.cuda.synchronize()
    return pstats.Stats(host)


def python_lines(stats: pstats.Stats, top: int = 30) -> list[str]:
    """The Python functions of one step (python_profile) that held the host longest, by their own time
    and with their callees: which of the host's work keeps the GPU waiting (cProfile's overhead
    inflates every call; the order, not the ms, is the point). On a GPU the backward's Python runs on
    the autograd engine's thread, whose calls Python 3.12's profiler counts as callees of whatever the
    main thread is in: totals with callees around a backward can be off, own times hold."""
    rows = [(f"{Path(file).name}:{line}({name})", calls, own, total)
            for (file, line, name), (_, calls, own, total, _) in stats.stats.items()]
    lines = []
    for title, key in (("own time", 2), ("callees included", 3)):
        lines += ["", f"The host's Python functions in one step under cProfile, by {title}:", "",
                  "| function | calls | own ms | with callees ms |", "| --- | --- | --- | --- |"]
        lines += [f"| {where[:90]} | {calls} | {own * 1e3:.1f} | {total * 1e3:.1f} |"
                  for where, calls, own, total in sorted(rows, key=lambda r: r[key], reverse=True)[:top]]
    return lines


def _profile_lines(prof, kernels: list, summary: dict) -> list[str]:
    """The profile's tables: kernel families, the costliest kernels, our annotated ranges."""
    wall_s, busy_s = summary["wall_s"], summary["kernel_s"]
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:25]
    lines = [f"step {wall_s * 1e3:.1f} ms wall, {busy_s * 1e3:.1f} ms of GPU kernels "
             f"({100 * busy_s / wall_s:.1f}%), the GPU idle {summary['idle_s'] * 1e3:.1f} ms", "",
             "| kernel family | ms | share of the step |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v * 1e3:.1f} | {100 * v / wall_s:.1f}% |" for k, v in summary["families"].items()]
    lines += ["", "| kernel | family | calls | ms |", "| --- | --- | --- | --- |"]
    lines += [f"| {e.key[:90]} | {kernel_family(e.key)} | {e.count} | {e.self_device_time_total / 1e3:.1f} |"
              for e in top]
    lines += ["", "Our annotated ranges (host time from entry to exit; GPU time of the kernels they launch):", "",
              "| range | calls | host ms | GPU ms |", "| --- | --- | --- | --- |"]
    lines += [f"| {e.key} | {e.count} | {e.cpu_time_total / 1e3:.2f} | {e.device_time_total / 1e3:.2f} |"
              for e in prof.key_averages() if e.key.startswith(ANNOTATION)]
    return lines + host_lines(prof.key_averages())


def host_lines(averages, top: int = 30) -> list[str]:
    """The ops the host spent longest in (from entry to exit, the ops they call included) beside the GPU
    time of the kernels they launched: where the GPU waits on a host that falls behind, the ops whose
    host time exceeds their GPU time."""
    ops = [e for e in averages if e.device_type.name == "CPU" and e.cpu_time_total > 0]
    ranked = sorted(ops, key=lambda e: e.cpu_time_total, reverse=True)[:top]
    lines = ["", "Host time by op (entry to exit, callees included):", "",
             "| op | calls | host ms | host us per call | GPU ms |", "| --- | --- | --- | --- | --- |"]
    return lines + [f"| {e.key[:70]} | {e.count} | {e.cpu_time_total / 1e3:.1f} | "
                    f"{e.cpu_time_total / e.count:.0f} | {e.device_time_total / 1e3:.1f} |" for e in ranked]


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def matmul_calls(events) -> dict[tuple[str, str], tuple[list[float], set[str]]]:
    """Per (op, input shapes) of the profiled matmuls: each call's GPU ms (the kernels it launched) and
    those kernels' names. A shape's rate can fall short because cuBLAS picked a slow kernel (every call
    slow, one name) or because the clock dropped around it (calls spread, same kernel)."""
    calls: dict[tuple[str, str], tuple[list[float], set[str]]] = {}
    for e in events:
        if e.name in MATMUL_OPS and e.kernels:
            times, names = calls.setdefault((e.name, str(e.input_shapes)), ([], set()))
            times.append(sum(k.duration for k in e.kernels) / 1e3)
            names.update(k.name[:48] for k in e.kernels)
    return calls


def _spread(calls: dict, key: tuple[str, str]) -> str:
    times, names = calls.get(key, ([], set()))
    if not times:
        return " | |"
    times = sorted(times)
    return (f" {times[0]:.2f} / {times[len(times) // 2]:.2f} / {times[-1]:.2f} |"
            f" {', '.join(sorted(names))} |")


def matmul_lines(events, calls: dict | None = None, top: int = 20) -> list[str]:
    """The `top` matmuls by GPU time, per op and input shapes (torch.profiler's events grouped by
    input shape, with its FLOP counts): calls, the GPU time of the kernels they launched, and the rate
    that reached: which GEMMs fall short of the card's, and by how much; with `calls` (matmul_calls),
    each call's time (min / median / max) and the kernels that ran."""
    rows = sorted((e for e in events if e.key in MATMUL_OPS and e.flops and e.device_time_total > 0),
                  key=lambda e: e.device_time_total, reverse=True)
    lines = ["", "The costliest matmuls by shape (FLOPs as torch.profiler counts them; time: their kernels'):", "",
             "| op | input shapes | calls | GPU ms | TFLOPS |" + (" ms per call (min / median / max) | kernels |"
                                                                  if calls is not None else ""),
             "| --- | --- | --- | --- | --- |" + (" --- | --- |" if calls is not None else "")]
    return lines + [f"| {e.key} | {e.input_shapes} | {e.count} | {e.device_time_total / 1e3:.1f} | "
                    f"{e.flops / e.device_time_total / 1e6:.0f} |"
                    + (_spread(calls, (e.key, str(e.input_shapes))) if calls is not None else "")
                    for e in rows[:top]]


def _caller(event) -> str:
    """The autograd node (backward) or the nearest ATen op above `event` that launched no kernel itself:
    what called the op (e.g. a pad's copy, a split's backward)."""
    parent = event.cpu_parent
    while parent is not None and not (parent.name.startswith("autograd::engine") or parent.kernels
                                      or parent.cpu_parent is None):
        parent = parent.cpu_parent
    return "" if parent is None else parent.name.removeprefix("autograd::engine::evaluate_function: ")[:40]


def op_lines(events, top: int = 40) -> list[str]:
    """The `top` non-matmul ATen ops by the GPU time of the kernels each launched itself, per (op, its
    caller, input shapes): which of the step's elementwise, copy and reduction kernels come from where."""
    rows: dict[tuple[str, str, str], list[float]] = {}
    for e in events:
        if e.kernels and e.name not in MATMUL_OPS:
            row = rows.setdefault((e.name, _caller(e), str(e.input_shapes)[:90]), [0, 0.0])
            row[0] += 1
            row[1] += sum(k.duration for k in e.kernels) / 1e3
    lines = ["", "The costliest other ops (kernels each launched itself, by op, caller and input shapes):", "",
             "| op | caller | input shapes | calls | GPU ms | ms per call |", "| --- | --- | --- | --- | --- | --- |"]
    ranked = sorted(rows.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return lines + [f"| {op} | {caller} | {shapes} | {n} | {ms:.1f} | {ms / n:.3f} |"
                    for (op, caller, shapes), (n, ms) in ranked]


def _gaps(kernels):
    """Each gap in which the GPU ran no kernel, in time order: (when: from the first kernel's start, how
    long, the label of the kernel that ran until it, of the kernel that ends it). kernels: (start, end,
    label) on the device's clock, every stream together (a kernel overlapping another on another stream
    leaves no gap)."""
    busy_until = last = first = None
    for start, end, label in sorted(kernels):
        first = start if first is None else first
        if busy_until is not None and start > busy_until:
            yield busy_until - first, start - busy_until, last, label
        if busy_until is None or end >= busy_until:
            busy_until, last = end, label


def idle_gaps(kernels, top: int = 20) -> list[tuple[str, int, float, float]]:
    """The GPU's idle time between kernels (_gaps), each gap charged to the kernel that ends it: what the
    host was late to launch. Per label: (label, gaps, total, largest), the `top` by total."""
    totals: dict[str, list] = {}
    for _, gap, _, label in _gaps(kernels):
        row = totals.setdefault(label, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += gap
        row[2] = max(row[2], gap)
    ranked = sorted(totals.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return [(label, n, total, largest) for label, (n, total, largest) in ranked]


def largest_gaps(kernels, top: int = 10) -> list[tuple[float, float, str, str]]:
    """The `top` longest single gaps (_gaps), longest first: where in the step the host fell behind, which
    the totals per label of idle_gaps do not say."""
    return sorted(_gaps(kernels), key=lambda gap: gap[1], reverse=True)[:top]


def _launcher(op) -> str:
    """A kernel's label for idle_gaps: the op that launched it, under its outermost caller (an autograd
    node in the backward, a compiled region, the optimizer's step, our annotated range)."""
    if op is None:
        return "(no launching op)"
    root = op
    while root.cpu_parent is not None:
        root = root.cpu_parent
    caller = root.name.removeprefix("autograd::engine::evaluate_function: ")[:48]
    return op.name[:48] if root is op else f"{op.name[:48]} <- {caller}"


def launched_kernels(events) -> list[tuple[float, float, str]]:
    """Each kernel on the GPU (device_work) as (start, end, the label of the op that launched it:
    _launcher). An op's event lists the kernels it launched by name and duration, the values of the
    kernels' own events (torch 2.11's events carry no other link between them); kernels of one name and
    duration go to their ops in launch order."""
    waiting: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    launchers = (e for e in events if e.device_type.name == "CPU" and e.kernels)
    for op in sorted(launchers, key=lambda e: e.time_range.start):
        for kernel in op.kernels:
            waiting[(kernel.name, kernel.duration)].append(op)
    launched = []
    for e in sorted(device_work(events), key=lambda e: e.time_range.start):
        ops = waiting.get((e.name, e.time_range.end - e.time_range.start))
        launched.append((e.time_range.start, e.time_range.end, _launcher(ops.popleft() if ops else None)))
    return launched


def idle_lines(events, top: int = 20) -> list[str]:
    """Where the GPU waited for the host (torch.profiler's events of one step: each device kernel and
    the CPU op that launched it): idle_gaps by launching op."""
    kernels = launched_kernels(events)
    lines = ["", "Where the GPU idled between kernels (each gap charged to the kernel after it, by the op that "
             "launched it and its outermost caller):", "",
             "| launched by | gaps | idle ms | largest ms |", "| --- | --- | --- | --- |"]
    lines += [f"| {label} | {n} | {total / 1e3:.1f} | {largest / 1e3:.2f} |"
              for label, n, total, largest in idle_gaps(kernels, top)]
    lines += ["", "The longest single gaps (when: ms after the step's first kernel began):", "",
              "| when ms | idle ms | after | before |", "| --- | --- | --- | --- |"]
    return lines + [f"| {when / 1e3:.1f} | {gap / 1e3:.2f} | {after} | {before} |"
                    for when, gap, after, before in largest_gaps(kernels)]


def host_syncs(trainer: Trainer, forward_backward_func=None) -> list[tuple[str, int]]:
    """One more training step under torch's sync debug mode: each operation that made the host wait
    for the GPU (a blocking copy, .item(), a shape read from device data), counted by where it was
    called ("innermost frame of the package or this harness <- innermost frame"; autograd replays its threads'
    warnings where backward was called), most first. While the host waits it queues no kernels, so
    the GPU idles from the wait's end until the host catches up."""
    sites: collections.Counter = collections.Counter()

    def seen(message, *_):
        if "synchronizing" in str(message):
            stack = [f for f in traceback.extract_stack()[:-1] if f.filename != warnings.__file__]
            ours = [f for f in stack if f"{os.sep}megatron_hetero{os.sep}" in f.filename or f.filename == __file__]
            where = [f"{Path(f.filename).name}:{f.lineno}" for f in (ours[-1:] + stack[-1:])]
            sites[" <- ".join(dict.fromkeys(where))] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step(forward_backward_func)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites.most_common()


def _sync_lines(syncs: list[tuple[str, int]]) -> list[str]:
    lines = ["", f"The host waited for the GPU {sum(n for _, n in syncs)} times in one more step (host_syncs):", "",
             "| called at (ours <- innermost) | waits |", "| --- | --- |"]
    return lines + [f"| {site} | {n} |" for site, n in syncs]


def run_reporting_errors(run_fn, opts) -> int:
    """run_fn(opts), a layout or argument mistake reported as one `error:` line (exit status 2)."""
    try:
        run_fn(opts)
    except (LayoutError, ArgsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _timed(fn, barrier: bool = True) -> float:
    """Seconds `fn` takes with the GPU work it queues (the slowest rank's with `barrier`)."""
    if barrier:
        dist.barrier()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if barrier:
        dist.barrier()
    return time.perf_counter() - start


def measure_checkpoint(trainer: Trainer, w: BenchWorkload, layout_name: str, directory: str, out: str,
                       repeats: int = 2) -> dict:
    """After one training step (so that the optimizer holds state), Megatron's save_checkpoint and
    load_checkpoint of the trainer's model and optimizer into `directory`, `repeats` times each:
    seconds per save and per load (the fastest), bytes on disk. Rank 0 appends the record to `out`."""
    from megatron.training import training

    trainer.train_step()
    args, model, optimizer, scheduler = trainer.args, trainer.model, trainer.optimizer.optimizer, trainer.scheduler
    args.save = args.load = directory
    saves = [_timed(lambda: training.save_checkpoint(1, model, optimizer, scheduler, 0, {})) for _ in range(repeats)]
    loads = [_timed(lambda: training.load_checkpoint(model, optimizer, scheduler)) for _ in range(repeats)]
    files = [f for f in (Path(directory) / "iter_0000001").rglob("*") if f.is_file()]
    params = sum(p.numel() for m in trainer.hetero.run.modules.values() if m.held for p in m.part.parameters())
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, params)
    cuda = torch.cuda.is_available()
    record = dict(workload=w.name, layout=layout_name, gpus=dist.get_world_size(), llm_layers=w.layers,
                  parameters_held=counts, save_s=min(saves), load_s=min(loads), saves_s=saves, loads_s=loads,
                  checkpoint_bytes=sum(f.stat().st_size for f in files), files=len(files),
                  distributed_optimizer=args.use_distributed_optimizer, bf16=args.bf16,
                  date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if cuda else "cpu",
                  torch=torch.__version__)
    if dist.get_rank() == 0:
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record))
    return record
