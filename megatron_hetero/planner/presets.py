"""The workload presets: one table that tools/plan_layout.py plans and tools/bench_e2e.py,
bench_mimo.py and check_planner.py train or check.

A preset's shapes are the model as planned (e.g. SigLIP's MLP width); `BenchWorkload` is the same
preset as the trainer builds it for bench_e2e (MLPs 4 x hidden, the demo tokenizer's vocabulary),
and `trainer_workload` turns that back into the planner's terms, for the FLOPs the benchmarks count
and the shapes check_planner fits its calibration to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_hetero.planner.counts import module_forward_flops_per_sample, window_attention_keys
from megatron_hetero.planner.shapes import ModuleShape, Workload


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
    # Long context (issue 28's headline): W4's encoder with 16 images of 1024 tokens per sample
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


# Qwen2.5-VL-7B (its Hub config.json's sizes): the vision tower (32 layers of width 1280, windows of
# 112 px in all but layers 7, 15, 23, 31, 2x2 merger into the LLM's width) and the Qwen2 LLM.
QWEN2_5_VL_7B = dict(
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
    text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6, hidden_act="silu",
                     rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}),
    tie_word_embeddings=False)
# Its Hub image processor's limits (preprocessor_config.json): images keep their size up to 12.8M px.
QWEN2_5_VL_PROCESSOR = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2, temporal_patch_size=2)
# 8 images per sample from 224 x 224 to 1344 x 1344 px, of several aspect ratios (width, height), and
# their patch grids (rows, columns of 14 px) as that processor resizes them (to multiples of 28 px;
# tests/test_planner.py checks them against transformers' smart_resize).
QWEN_IMAGES = {(224, 224): (16, 16), (336, 448): (32, 24), (512, 384): (28, 36), (672, 672): (48, 48),
               (896, 504): (36, 64), (1008, 756): (54, 72), (1120, 1120): (80, 80), (1344, 1344): (96, 96)}
# A CPU-sized Qwen2.5-VL for checking the tools: 4 images of 56-112 px into a 2-layer LLM.
QWEN2_5_VL_TINY = dict(
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
    text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256,
                     rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6}),
    image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
QWEN_TINY_IMAGES = {(56, 56): (4, 4), (84, 56): (4, 6), (112, 112): (8, 8), (56, 84): (6, 4)}


@dataclass(frozen=True)
class FamilyBench:
    """A VLM family's model as bench_e2e trains it: its Hugging Face config (config.json's fields),
    its image processor's settings, every sample's images (width, height in px) -> their patch grids
    (rows, columns), the sequence length and batch."""

    model_type: str
    config: dict
    processor: dict
    images: dict
    seq_length: int
    global_batch: int
    micro_batch: int

    def workload(self, llm_layers: int = 0, seq_length: int = 0) -> Workload:
        """The planner's shapes (a Qwen2.5-VL-style tower): the ViT's attention counted as it runs
        (each image within itself in the full-attention layers, within windows in the others); each
        image's t*h*w / merge^2 rows into the LLM through the merger's MLP (width merge^2 x hidden)."""
        v, t = self.config["vision_config"], self.config["text_config"]
        grids = list(self.images.values())
        tokens, merge = sum(h * w for h, w in grids) // len(grids), v["spatial_merge_size"]
        keys = window_attention_keys(grids, v["window_size"] // v["patch_size"], merge,
                                     len(v["fullatt_block_indexes"]), v["depth"])
        vision = ModuleShape("vision", "encoder", hidden=v["hidden_size"], layers=v["depth"], heads=v["num_heads"],
                             ffn=v["intermediate_size"], gated_mlp=True, tokens_per_item=tokens,
                             items_per_sample=len(grids), output_tokens_per_item=tokens // merge**2,
                             projector_ffn=v["hidden_size"] * merge**2, attention_keys=keys)
        llm = ModuleShape("llm", "llm", hidden=t["hidden_size"], layers=llm_layers or t["num_hidden_layers"],
                          heads=t["num_attention_heads"], kv_heads=t["num_key_value_heads"], ffn=t["intermediate_size"],
                          gated_mlp=True, seq_length=seq_length or self.seq_length, vocab=t["vocab_size"])
        return Workload((vision,), llm, global_batch=self.global_batch, micro_batch=self.micro_batch)


FAMILY_BENCHES = {
    "qwen2_5_vl_7b": FamilyBench("qwen2_5_vl", QWEN2_5_VL_7B, QWEN2_5_VL_PROCESSOR, QWEN_IMAGES, 8192, 4, 1),
    "qwen2_5_vl_tiny": FamilyBench("qwen2_5_vl", QWEN2_5_VL_TINY, QWEN2_5_VL_PROCESSOR, QWEN_TINY_IMAGES, 256, 4, 1),
}
PRESETS["qwen2_5_vl_7b"] = Preset(
    FAMILY_BENCHES["qwen2_5_vl_7b"].workload(), "Qwen2.5-VL-7B: 8 images of 224-1344 px per sample (6536 rows) "
    "into its 28-layer LLM at 8K, global batch 4", 1)


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
    # height in pixels) the images of every sample, at native resolution.
    family: str = ""
    image_sizes: tuple[tuple[int, int], ...] = ()

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
    (vision,), llm = shapes.encoders, shapes.llm
    return BenchWorkload(name, 0, bench.processor["patch_size"], vision.items_per_sample, vision.hidden, vision.layers,
                         vision.heads, llm.hidden, llm.heads, llm.layers, llm.seq_length, bench.global_batch,
                         bench.micro_batch, family=bench.model_type, image_sizes=tuple(bench.images))


FAMILY_BENCH_WORKLOADS = {name: _family_bench_workload(name, bench) for name, bench in FAMILY_BENCHES.items()}


def trainer_workload(w: BenchWorkload, vocab: int, frozen_encoder: bool) -> Workload:
    """The workload in the planner's terms as the trainer builds it (the shapes whose FLOPs, time
    and memory the planner models), at the workload's micro batch size."""
    if w.family:
        shapes = FAMILY_BENCHES[w.name].workload(w.layers, w.seq_length)
        encoder = replace(shapes.encoders[0], frozen=frozen_encoder)
        return replace(shapes, encoders=(encoder,), global_batch=w.global_batch, micro_batch=w.micro_batch)
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
    """Model FLOPs of one global batch per module, counted by the planner's formulas (forward x3
    when trained, x1 when frozen; projector and logits included)."""
    shapes = trainer_workload(w, vocab, frozen_encoder)
    return {key: (1 if shape.frozen else 3) * w.global_batch * module_forward_flops_per_sample(shape, w.hidden)
            for key, shape in (("encoder", shapes.encoders[0]), ("llm", shapes.llm))}
