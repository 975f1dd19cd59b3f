"""The planner's FLOPs of each VLM family as it runs (planner/families.py), against the matmul FLOPs
the family's own model does: torch's FlopCounterMode formulas over one forward of one sample of the
family's CPU-sized bench preset (the model bench_e2e trains, built by the family's code on one
process). Why: bench_e2e's TFLOPS/GPU and encoder share, and the planner's step times, are only as
right as this count.

What the counter sees and the planner counts are the same GEMMs: the patch embedding, every
layer's projections and MLP (an MoE layer's router and the top-k experts each token goes to), the
attention's two products over the keys each query really attends to (Qwen2.5-VL's windows and whole
images, Qwen3-VL's and InternViT's images with the class token), the projectors (after InternVL's
pixel shuffle; Qwen3-VL's DeepStack mergers beside the main one) and the LLM's output layer. SDPA
runs its math path here, which computes causal attention's whole square: the LLM is counted with
every key (the planner's default counts half, the kernels skipping masked blocks). Biases, norms,
softmax and element-wise work are neither's. The counter also sees Qwen2.5-VL's M-RoPE frequencies
(megatron-core's outer product of positions and inverse frequencies as a bmm: 3 x head_dim / 2 x
sequence multiply-adds, 2e-4 of the tiny LLM's FLOPs, 1e-6 of a 7B's), which the planner leaves out:
the counts agree to TOLERANCE.

Also: the presets' image grids and tiles are what the families' processors make of the images.
"""

import json
from dataclasses import replace

import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import megatron_hetero.patches
from megatron_hetero.planner.counts import module_forward_flops_per_sample
from megatron_hetero.planner.families import FAMILY_BENCHES
from megatron_hetero.planner.presets import FAMILY_BENCH_WORKLOADS, trainer_workload

TOLERANCE = 1e-3  # relative: the same GEMMs on both sides but M-RoPE's frequencies
TINY = sorted(name for name in FAMILY_BENCH_WORKLOADS if name.endswith("_tiny"))


class MatmulFlops(TorchDispatchMode):
    """FLOPs of the ops torch's FlopCounterMode counts (its formulas: matmuls, convolutions,
    attention kernels), summed: FlopCounterMode's per-module tracking hooks every module's inputs'
    gradients, which the model's forward-only step does not carry."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += count(*args, **kwargs, out_val=out)
        return out


def _measured_flops(w) -> dict[str, int]:
    """Matmul FLOPs of one forward of the workload's model on one sample: each encoder's alone (the
    vision tower; an omni family's audio encoder), and the LLM's as the whole model's (encoders,
    boundary, LLM with its logits) less the encoders'."""
    from bench import family_batch, family_sizes, global_microbatches

    from megatron_hetero.hf.checkpoint import model_under
    from megatron_hetero.models.kinds import ENCODER_KINDS, grids_key
    from megatron_hetero.schedules.forward_backward import step_context
    from megatron_hetero.schedules.pipeline import run_stage
    from megatron_hetero.schedules.stages import GivenRows, LLMStage
    from megatron_hetero.training.evaluation import logits_step, route_media

    megatron_hetero.patches.apply()  # megatron-core on CPUs
    (kwargs,) = global_microbatches(family_batch(w), 1)
    measured = {}
    with model_under(family_sizes(w)) as model, sdpa_kernel(SDPBackend.MATH):
        for kind in (k for k in ENCODER_KINDS.values() if k.input_key in kwargs):
            grids = kwargs.get(grids_key(kind.name))
            with MatmulFlops() as encoder:
                model.run.modules[kind.name].part(kwargs[kind.input_key], *(() if grids is None else (grids,)))
            measured[kind.name] = encoder.flops
        ctx = step_context(model, logits_step, [kwargs], forward_only=True)
        with MatmulFlops() as whole:
            run_stage(LLMStage(ctx, GivenRows(route_media(ctx))), 1, ctx.clock)
    return {**measured, "llm": whole.flops - sum(measured.values())}


def _planned_flops(w) -> dict[str, float]:
    """The planner's forward FLOPs per sample of each module as the trainer builds the workload (its
    padded vocabulary), the LLM's attention over every key (the module docstring)."""
    from megatron_hetero.planner.presets import trainer_vocab_size

    shapes = trainer_workload(w, trainer_vocab_size(w), frozen_encoder=False)
    llm = replace(shapes.llm, attention_keys=float(shapes.llm.seq_length))
    return {shape.name: module_forward_flops_per_sample(shape, llm.hidden) for shape in (*shapes.encoders, llm)}


@pytest.mark.parametrize("name", TINY)
def test_planner_counts_each_family_as_its_model_runs(name):
    w = replace(FAMILY_BENCH_WORKLOADS[name], global_batch=1, micro_batch=1)
    measured, planned = _measured_flops(w), _planned_flops(w)
    assert planned.keys() == measured.keys()
    for module in planned:
        assert planned[module] == pytest.approx(measured[module], rel=TOLERANCE), (module, planned, measured)


def test_the_presets_image_items_are_the_processors():
    """Every family preset's images: the patch grids its processor's smart_resize makes (native
    resolution) or the tile counts of InternVL's processor (dynamic tiling and a thumbnail)."""
    from transformers import GotOcr2ImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for bench in FAMILY_BENCHES.values():
        p = bench.processor
        for (width, height), items in bench.images.items():
            if bench.model_type == "internvl":
                tiles = GotOcr2ImageProcessorPil(**p).get_number_of_image_patches(height, width,
                                                                                  {"crop_to_patches": True})
                assert tiles == items, (bench.model_type, width, height)
                continue
            h, w = smart_resize(height, width, p["patch_size"] * p["merge_size"], p["min_pixels"], p["max_pixels"])
            assert (h // p["patch_size"], w // p["patch_size"]) == items, (bench.model_type, width, height)


def test_each_preset_sits_in_its_registered_familys_folder():
    """A family's presets come with the family: every presets.json entry names a registered family
    (families.REGISTRY) whose module is the folder holding the file, a vision shape the planner counts
    and, where the config has an audio encoder, an audio shape."""
    from megatron_hetero.families import REGISTRY
    from megatron_hetero.planner.families import AUDIO_SHAPES, PRESET_FILES, VISION_SHAPES

    for path in PRESET_FILES:
        for name, entry in json.loads(path.read_text()).items():
            module = REGISTRY[entry["model_type"]][1].partition(":")[0]
            assert module == f"megatron_hetero.families.{path.parent.name}", (path, name, module)
            assert entry["vision_shape"] in VISION_SHAPES, (path, name)
            assert ("audio_config" in entry["config"]) == (entry.get("audio_shape") in AUDIO_SHAPES), (path, name)
