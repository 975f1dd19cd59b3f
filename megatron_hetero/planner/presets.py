"""The workload presets: one table that tools/plan_layout.py plans and benchmarks/bench_e2e.py,
bench_mimo.py and check_planner.py train or check.

A preset's shapes are the model as planned (e.g. SigLIP's MLP width); `BenchWorkload` is the same
preset as the trainer builds it for bench_e2e (MLPs 4 x hidden, the demo tokenizer's vocabulary),
and `trainer_workload` turns that back into the planner's terms, for the FLOPs the benchmarks count
and the shapes check_planner fits its calibration to. The VLM families' presets (their own models,
bench_e2e's family workloads) are in each family's folder, read by planner/families.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_hetero.planner.counts import module_forward_flops_per_sample
from megatron_hetero.planner.families import FAMILY_BENCHES, FamilyBench
from megatron_hetero.planner.shapes import ModuleShape, Workload
from megatron_hetero.spec.sizes import ModelSizes, padded_vocab_size


@dataclass(frozen=True)
class Bench:
    """How bench_e2e trains a preset: square images of `image_size` pixels cut into patches of
    `patch_size` (one encoder token each), and its default batch (global, and per LLM DP rank and
    microbatch)."""

    image_size: int
    patch_size: int
    global_batch: int = 4
    micro_batch: int = 2


@dataclass(frozen=True)
class Preset:
    workload: Workload
    description: str
    gpus: int  # plan_layout's default GPU count
    bench: Bench | None = None  # None: bench_e2e does not train it


def _vit_so400m(frozen: bool) -> ModuleShape:
    """SigLIP-so400m shape: 729 patches per 384-px image, 16 images per sample; the projector is
    the trainer's MLP (hidden 4 x the LLM's)."""
    return ModuleShape("vision", "encoder", hidden=1152, layers=27, heads=16, ffn=4304,
                       tokens_per_item=729, items_per_sample=16, projector_ffn=4 * 4096, frozen=frozen)


def _llm_7b(seq_length: int) -> ModuleShape:
    """A 7B-class LLM as the trainer builds it (GPTModel, MLP 4 x hidden, no gating), with a 32K
    vocabulary."""
    return ModuleShape("llm", "llm", hidden=4096, layers=32, heads=32, ffn=4 * 4096,
                       seq_length=seq_length, vocab=32000)


# bench_e2e's SigLIP images: 378 px in patches of 14, 27 x 27 = 729 tokens.
_SIGLIP_IMAGES = Bench(image_size=378, patch_size=14)

PRESETS = {
    "W1": Preset(Workload((_vit_so400m(False),), _llm_7b(16384), global_batch=16),
                 "SigLIP-so400m ViT (16 images x 729 tokens per sample) into a 7B LLM at 16K, global batch 16", 2,
                 _SIGLIP_IMAGES),
    "W2": Preset(Workload((_vit_so400m(False),), _llm_7b(32768), global_batch=8),
                 "W1 at 32K context (the LLM needs CP), global batch 8", 2, _SIGLIP_IMAGES),
    "W3": Preset(Workload((_vit_so400m(True),), _llm_7b(16384), global_batch=16),
                 "W1 with the vision encoder frozen (forward only)", 2, _SIGLIP_IMAGES),
    # Encoder-heavy: InternViT-6B's layer (hidden 3200, 25 heads of 128, MLP 12800 = 4 x hidden, as
    # the trainer builds it) at a third of its 45 layers (1.96B parameters, so that it fits 2 GPUs
    # beside the LLM shrunk as in the W1-W3 runs), 8 images of 448 px (1024 patches of 14 px each,
    # all 1024 rows into the LLM: the trainer has no pixel shuffle), into W1's 7B LLM at 16K. Its 25
    # heads split over no TP size but 1, 5 and 25: Megatron's homogeneous layout cannot give the LLM
    # TP without the encoder.
    "W4": Preset(Workload(
        (ModuleShape("vision", "encoder", hidden=3200, layers=15, heads=25, ffn=12800, tokens_per_item=1024,
                     items_per_sample=8, projector_ffn=4 * 4096),),
        _llm_7b(16384), global_batch=16),
        "InternViT-6B-wide ViT at 15 layers (8 images x 1024 tokens per sample) into a 7B LLM at 16K, "
        "global batch 16", 2, Bench(image_size=448, patch_size=14)),
    # Long context (the 2-GPU headline): W4's encoder with 16 images of 1024 tokens per sample
    # (multi-image or video-like input: half of the fused sequence) into the 7B LLM at 32K, global
    # batch 2 in microbatches of 1. The LLM needs model parallelism or recomputation for its memory
    # at this length, the encoder does not; its 25 heads rule out Megatron's TP for it, so the
    # homogeneous layouts left are DP (with recomputation to fit), CP with the encoder replicated
    # on both CP ranks, and PP with the encoder on the first stage.
    "W5": Preset(Workload(
        (ModuleShape("vision", "encoder", hidden=3200, layers=15, heads=25, ffn=12800, tokens_per_item=1024,
                     items_per_sample=16, projector_ffn=4 * 4096),),
        _llm_7b(32768), global_batch=2, distributed_optimizer=True, allow_recompute=True),
        "InternViT-6B-wide ViT at 15 layers (16 images x 1024 tokens per sample) into a 7B LLM at 32K, "
        "global batch 2", 2, Bench(image_size=448, patch_size=14, global_batch=2, micro_batch=1)),
    # W5 at 64K: 32 images of 1024 tokens per sample (video-like: half of the fused sequence).
    # Attention's quadratic term grows with the LLM's sequence while the encoder's per-image work
    # does not, so recomputation costs the homogeneous layouts more than at 32K.
    "W6": Preset(Workload(
        (ModuleShape("vision", "encoder", hidden=3200, layers=15, heads=25, ffn=12800, tokens_per_item=1024,
                     items_per_sample=32, projector_ffn=4 * 4096),),
        _llm_7b(65536), global_batch=2, distributed_optimizer=True, allow_recompute=True),
        "W5 at 64K (32 images x 1024 tokens per sample), global batch 2", 2,
        Bench(image_size=448, patch_size=14, global_batch=2, micro_batch=1)),
    "tiny": Preset(Workload(
        (ModuleShape("vision", "encoder", hidden=64, layers=2, heads=4, ffn=256, tokens_per_item=16,
                     items_per_sample=2, projector_ffn=256),),
        ModuleShape("llm", "llm", hidden=64, layers=2, heads=4, ffn=256, seq_length=64, vocab=128),
        global_batch=8),
        "a CPU-sized check of the tools (2 images x 16 tokens into a 64-token sequence), global batch 8", 2,
        Bench(image_size=32, patch_size=8, global_batch=8)),
    # A 6B-class ViT: InternViT-6B's width (hidden 3200, MLP 12800) with 48 layers and 32 heads
    # instead of its 45 and 25, so that TP up to 8 and PP divide it (5.9B parameters).
    # 448-px tiles of 1024 patches, 12 tiles per sample (InternVL's default dynamic tiling),
    # pixel shuffle to 256 rows per tile, an MLP projector of width 8192; a Llama-70B-shaped LLM
    # (GQA 8 groups, SwiGLU 28672, vocabulary 128256) at 8K; global batch 128 (1M tokens).
    "paper": Preset(Workload(
        (ModuleShape("vision", "encoder", hidden=3200, layers=48, heads=32, ffn=12800, tokens_per_item=1024,
                     items_per_sample=12, output_tokens_per_item=256, projector_ffn=8192),),
        ModuleShape("llm", "llm", hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, gated_mlp=True,
                    seq_length=8192, vocab=128256),
        global_batch=128, distributed_optimizer=True),
        "6B ViT (12 tiles x 1024 tokens, 256 rows each into the LLM) into a 70B LLM at 8K, global batch 128", 64),
    # An MoE VLM shaped like Qwen3-VL-30B-A3B: SigLIP-so400m (8 images of 729 patches per sample,
    # projector 4 x the LLM's hidden) into Qwen3-30B-A3B's LLM (48 layers, hidden 2048, 32 heads
    # with 4 key/value groups, 128 SwiGLU experts of width 768 with top-8 routing: 30B parameters,
    # 3B active) at 8K. 8 GPUs hold its experts only split over expert parallelism.
    "moe": Preset(Workload(
        (ModuleShape("vision", "encoder", hidden=1152, layers=27, heads=16, ffn=4304, tokens_per_item=729,
                     items_per_sample=8, projector_ffn=4 * 2048),),
        ModuleShape("llm", "llm", hidden=2048, layers=48, heads=32, kv_heads=4, ffn=768, gated_mlp=True,
                    seq_length=8192, vocab=151936, experts=128, topk=8),
        global_batch=32, distributed_optimizer=True),
        "SigLIP ViT (8 images x 729 tokens per sample) into a Qwen3-30B-A3B-shaped MoE LLM (128 experts, "
        "top-8) at 8K, global batch 32", 8),
}


# The VLM families' presets that plan_layout offers too (families/<name>/presets.json: "plan").
PRESETS.update({name: Preset(bench.workload(), *bench.plan) for name, bench in FAMILY_BENCHES.items() if bench.plan})


@dataclass(frozen=True)
class BenchWorkload:
    """A preset as bench_e2e trains it: the trainer's vision encoder and GPTModel (MLPs 4 x hidden),
    the LLM's depth and the batch sizes overridable (`sized_workload`); `frozen`: the preset
    freezes the encoder, so the layout must too."""

    name: str
    image_size: int
    patch_size: int
    images_per_sample: int
    enc_hidden: int
    enc_layers: int
    enc_heads: int
    hidden: int
    heads: int
    layers: int
    seq_length: int
    global_batch: int
    micro_batch: int
    frozen: bool = False
    # A VLM family's model (megatron_hetero/families) instead of the reference one: its sizes from
    # FAMILY_BENCHES[name]'s Hugging Face config (the LLM's depth `layers`), `image_sizes` (width,
    # height in pixels) the images of every sample, at native resolution, and `video_sizes` (width,
    # height, seconds, fps) its videos (with their audio tracks where the family takes audio).
    family: str = ""
    image_sizes: tuple[tuple[int, int], ...] = ()
    video_sizes: tuple[tuple[int, int, float, float], ...] = ()

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _bench_workload(name: str, preset: Preset) -> BenchWorkload:
    (vision,), llm, bench = preset.workload.encoders, preset.workload.llm, preset.bench
    assert vision.name == "vision" and vision.rows_per_item == vision.tokens_per_item, name  # the trainer's ViT
    workload = BenchWorkload(name, bench.image_size, bench.patch_size, vision.items_per_sample, vision.hidden,
                             vision.layers, vision.heads, llm.hidden, llm.heads, llm.layers, llm.seq_length,
                             bench.global_batch, bench.micro_batch, vision.frozen)
    assert workload.tokens_per_image == vision.tokens_per_item, name
    return workload


BENCH_WORKLOADS = {name: _bench_workload(name, preset) for name, preset in PRESETS.items() if preset.bench}


def _family_bench_workload(name: str, bench: FamilyBench) -> BenchWorkload:
    shapes = bench.workload()
    vision, llm = shapes.encoders[0], shapes.llm  # the vision tower first (an omni model's audio encoder after)
    patch = bench.config["vision_config"]["patch_size"]
    return BenchWorkload(name, 0, patch, vision.items_per_sample, vision.hidden, vision.layers, vision.heads,
                         llm.hidden, llm.heads, llm.layers, llm.seq_length, bench.global_batch, bench.micro_batch,
                         family=bench.model_type, image_sizes=bench.sample_images(), video_sizes=bench.sample_videos())


FAMILY_BENCH_WORKLOADS = {name: _family_bench_workload(name, bench) for name, bench in FAMILY_BENCHES.items()}


def resized_workload(w: BenchWorkload, seq_length: int = 0, items_per_sample: int = 0,
                     image_size: int = 0) -> BenchWorkload:
    """The workload at another LLM sequence length, images per sample (a family's preset images, or
    videos where it has videos, cycled to that count) or image size in px (square; the reference model's images only: a
    family's images are its processor's native sizes); 0 keeps the workload's. ValueError where a
    family is given an image size."""
    if image_size and w.family:
        raise ValueError(f"--image-size: {w.name} trains its preset's native-resolution images; "
                         "change their count with --items-per-sample instead")
    if image_size and image_size % w.patch_size:
        raise ValueError(f"--image-size {image_size}: not a multiple of {w.name}'s {w.patch_size}-px patches")
    w = replace(w, seq_length=seq_length or w.seq_length, image_size=image_size or w.image_size)
    if not items_per_sample:
        return w
    if w.family:
        bench = FAMILY_BENCHES[w.name]
        return replace(w, images_per_sample=items_per_sample, image_sizes=bench.sample_images(items_per_sample),
                       video_sizes=bench.sample_videos(items_per_sample))
    return replace(w, images_per_sample=items_per_sample)


def trainer_vocab_size(w: BenchWorkload | None = None) -> int:
    """The padded vocabulary the trainer builds `w` with: a VLM family's own (its config's), else (the
    reference model, any workload) the demo tokenizer's (ModelSizes' default)."""
    vocab = FAMILY_BENCHES[w.name].config["text_config"]["vocab_size"] if w is not None and w.family else None
    return padded_vocab_size(ModelSizes(vocab_size=vocab) if vocab else ModelSizes())


def trainer_workload(w: BenchWorkload, vocab: int, frozen_encoder: bool) -> Workload:
    """The workload in the planner's terms as the trainer builds it (the shapes whose FLOPs, time
    and memory the planner models), at the workload's micro batch size."""
    if w.family:
        shapes = FAMILY_BENCHES[w.name].workload(w.layers, w.seq_length, w.image_sizes, w.video_sizes)
        encoders = tuple(replace(e, frozen=frozen_encoder) for e in shapes.encoders)
        return replace(shapes, encoders=encoders, llm=replace(shapes.llm, vocab=vocab), global_batch=w.global_batch,
                       micro_batch=w.micro_batch)
    encoder = ModuleShape("vision", "encoder", w.enc_hidden, w.enc_layers, w.enc_heads, 4 * w.enc_hidden,
                          tokens_per_item=w.tokens_per_image, items_per_sample=w.images_per_sample,
                          projector_ffn=4 * w.hidden, frozen=frozen_encoder)
    llm = ModuleShape("llm", "llm", w.hidden, w.layers, w.heads, 4 * w.hidden, seq_length=w.seq_length, vocab=vocab)
    return Workload((encoder,), llm, global_batch=w.global_batch, micro_batch=w.micro_batch)


def trainer_parameter_shapes(w: BenchWorkload, vocab: int) -> list[tuple[int, ...]]:
    """The shapes of every parameter the trainer builds for the workload, in its order (what its
    optimizer steps over): the ViT's patch and position embeddings, its layers and final norm, the
    projector MLP; the LLM's embedding, layers, final norm and output layer. Linear layers without
    biases (the models' default), LayerNorms with weight and bias; the MLPs of trainer_workload."""
    shapes = trainer_workload(w, vocab, frozen_encoder=False)
    enc, llm = shapes.encoders[0], shapes.llm
    assert not llm.kv_heads, "the bench workloads have no grouped-query attention"

    def layer(h: int, ffn: int) -> list[tuple[int, ...]]:
        return [(h,), (h,), (h, h), (3 * h, h), (h,), (h,), (ffn, h), (h, ffn)]
    e, h = enc.hidden, llm.hidden
    vision = ([(enc.tokens_per_item, e), (e, 3 * w.patch_size**2), (e,)] + layer(e, enc.ffn) * enc.layers
              + [(e,), (e,), (enc.projector_ffn, e), (h, enc.projector_ffn)])
    return vision + [(vocab, h)] + layer(h, llm.ffn) * llm.layers + [(h,), (h,), (vocab, h)]


def model_flops(w: BenchWorkload, vocab: int, frozen_encoder: bool) -> dict[str, float]:
    """Model FLOPs of one global batch per module (by name: each encoder's, the LLM's), counted by
    the planner's formulas (forward x3 when trained, x1 when frozen; projector and logits included)."""
    shapes = trainer_workload(w, vocab, frozen_encoder)
    return {shape.name: (1 if shape.frozen else 3) * w.global_batch * module_forward_flops_per_sample(shape, w.hidden)
            for shape in shapes.modules}
