"""The VLM families' benchmark presets (megatron_hetero/families) and their shapes as they run.

A family preset is a Hugging Face config (config.json's fields, the published model's sizes), its
image processor's settings and every sample's images; bench_e2e builds the family's own model from
it (random weights) and the planner counts it from the same numbers. Each family runs its vision
tower differently, so each has its own shape here, counting what its model computes:
- Qwen2.5-VL: native-resolution images, windowed attention in all but the full-attention layers
  (counts.window_attention_keys), SwiGLU MLPs, the 2x2 patch merger into the LLM;
- InternVL: fixed 448-px tiles plus InternViT's class token through the layers, pixel shuffle
  sending 1 row per 2x2 patches (256 of a tile's 1024) through the MLP projector (LayerNorm, Linear
  4h -> LLM hidden, GELU, Linear);
- Qwen3-VL: native-resolution images attending within themselves (no windows), GELU MLPs, the
  merger and one DeepStack merger of the same shape per DeepStack layer on every row;
the Qwen towers split an image over CP by whole merge blocks, InternViT does not (cp_split); and
the LLM from text_config: grouped-query attention with its own head size (Qwen3's 128 need not be
hidden / heads), SwiGLU, and for Qwen3-VL-MoE the top-k of its experts per token.

Plain data and arithmetic (no transformers import): tests/test_family_flops.py checks each family's
count against the matmul FLOPs of its model's forward, and the image grids and tiles against the
families' processors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_hetero.planner.counts import item_attention_keys, window_attention_keys
from megatron_hetero.planner.shapes import ModuleShape, Workload

_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1e6}
# The Qwen-VL tokenizers' <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>.
_QWEN_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653, tie_word_embeddings=False)

# Qwen2.5-VL-7B (its Hub config.json's sizes): the vision tower (32 layers of width 1280, windows of
# 112 px in all but layers 7, 15, 23, 31, 2x2 merger into the LLM's width) and the Qwen2 LLM.
QWEN2_5_VL_7B = dict(
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
    text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6, hidden_act="silu",
                     rope_parameters={**_QWEN_ROPE, "mrope_section": [16, 24, 24]}),
    **_QWEN_TOKENS)
# Its Hub image processor's limits (preprocessor_config.json): images keep their size up to 12.8M px.
QWEN2_5_VL_PROCESSOR = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2, temporal_patch_size=2)
# 8 images per sample from 224 x 224 to 1344 x 1344 px, of several aspect ratios (width, height), and
# their patch grids (rows, columns of 14 px) as that processor resizes them (to multiples of 28 px).
QWEN_IMAGES = {(224, 224): (16, 16), (336, 448): (32, 24), (512, 384): (28, 36), (672, 672): (48, 48),
               (896, 504): (36, 64), (1008, 756): (54, 72), (1120, 1120): (80, 80), (1344, 1344): (96, 96)}
# A CPU-sized Qwen2.5-VL for checking the tools: 4 images of 56-112 px into a 2-layer LLM.
QWEN2_5_VL_TINY = dict(
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
    text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, rope_parameters={**_QWEN_ROPE, "mrope_section": [2, 3, 3]}),
    image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
QWEN_TINY_IMAGES = {(56, 56): (4, 4), (84, 56): (4, 6), (112, 112): (8, 8), (56, 84): (6, 4)}

# InternVL3-8B (OpenGVLab/InternVL3-8B-hf's config.json): InternViT-300M (24 layers of width 1024,
# 448-px tiles of 14-px patches, LayerNorm, q/k/v biases, layer scale), pixel shuffle 0.5 and the MLP
# projector into a Qwen2.5-7B-shaped Qwen2 LLM; its tokenizer's <img>, </img> and <IMG_CONTEXT> ids.
INTERNVL3_8B = dict(
    vision_config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                       image_size=448, patch_size=14, attention_bias=True, layer_norm_eps=1e-6, hidden_act="gelu"),
    text_config=dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=151674, rms_norm_eps=1e-6,
                     rope_parameters=_QWEN_ROPE),
    downsample_ratio=0.5, projector_hidden_act="gelu", image_token_id=151667, image_seq_length=256,
    tie_word_embeddings=False)
INTERNVL_TOKENS = {"<img>": 151665, "</img>": 151666}
# Its image processor: 448-px tiles, 1 to 12 per image and a thumbnail when there are several.
INTERNVL_PROCESSOR = dict(size={"height": 448, "width": 448}, min_patches=1, max_patches=12,
                          image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
# 2 images per sample, 12 tiles (a 3 x 2 grid and a 2 x 2 one, each with its thumbnail): 3072 rows.
INTERNVL_IMAGES = {(1344, 896): 7, (896, 896): 5}
# A CPU-sized InternVL: 64-px tiles of 8-px patches (16 rows each), 4 tiles per sample.
INTERNVL_TINY = dict(
    vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=64, patch_size=8, attention_bias=True, layer_norm_eps=1e-6),
    text_config=dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256, rope_parameters=_QWEN_ROPE),
    image_token_id=250, image_seq_length=16, tie_word_embeddings=False)
INTERNVL_TINY_TOKENS = {"<img>": 251, "</img>": 252}
INTERNVL_TINY_PROCESSOR = dict(size={"height": 64, "width": 64}, min_patches=1, max_patches=4)
INTERNVL_TINY_IMAGES = {(128, 64): 3, (64, 64): 1}

# Qwen3-VL-8B (its Hub config.json's sizes): the vision tower (27 layers of width 1152, 16-px
# patches, DeepStack mergers after layers 8, 16, 24) and the Qwen3 LLM (head size 128, QK-norm,
# interleaved M-RoPE).
_QWEN3_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                     spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                     deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
_QWEN3_ROPE = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
QWEN3_VL_8B = dict(
    vision_config=dict(**_QWEN3_VISION, out_hidden_size=4096),
    text_config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                     rope_parameters=_QWEN3_ROPE),
    **_QWEN_TOKENS)
# Qwen3-VL-30B-A3B: the same tower into Qwen3-30B-A3B's MoE LLM (48 layers of width 2048, 32 heads
# of 128 with 4 key/value groups, 128 SwiGLU experts of width 768, top 8: 30B parameters, 3B active).
QWEN3_VL_30B_A3B = dict(
    vision_config=dict(**_QWEN3_VISION, out_hidden_size=2048),
    text_config=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, rope_parameters=_QWEN3_ROPE),
    **_QWEN_TOKENS)
# Its Hub image processor: 16-px patches, images resized to 64K..16M px.
QWEN3_VL_PROCESSOR = dict(min_pixels=65536, max_pixels=16777216, patch_size=16, merge_size=2, temporal_patch_size=2,
                          image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
# 8 images per sample of 224-1344 px (the smallest upscaled to 256 x 256): patch grids of 16 px.
QWEN3_IMAGES = {(224, 224): (16, 16), (352, 448): (28, 22), (512, 384): (24, 32), (672, 672): (42, 42),
                (896, 504): (32, 56), (1008, 756): (48, 64), (1120, 1120): (70, 70), (1344, 1344): (84, 84)}
# CPU-sized Qwen3-VL(-MoE): 3 vision layers (DeepStack after 0 and 2), a head size other than
# hidden / heads, 4 images of 32-64 px in 8-px patches.
_QWEN3_TINY_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=24, vocab_size=256, rms_norm_eps=1e-6,
                        rope_parameters={**_QWEN3_ROPE, "mrope_section": [4, 4, 4]})
QWEN3_VL_TINY = dict(
    vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                       deepstack_visual_indexes=[0, 2]),
    text_config=_QWEN3_TINY_TEXT, image_token_id=250, video_token_id=251, vision_start_token_id=252,
    vision_end_token_id=253, tie_word_embeddings=False)
QWEN3_VL_MOE_TINY = {**QWEN3_VL_TINY, "text_config": dict(**_QWEN3_TINY_TEXT, num_experts=4, num_experts_per_tok=2,
                                                          moe_intermediate_size=24)}
QWEN3_TINY_PROCESSOR = dict(min_pixels=1024, max_pixels=16384, patch_size=8, merge_size=2, temporal_patch_size=2)
QWEN3_TINY_IMAGES = {(32, 32): (4, 4), (48, 32): (4, 6), (64, 64): (8, 8), (32, 48): (6, 4)}


@dataclass(frozen=True)
class FamilyBench:
    """A VLM family's model as bench_e2e trains it: its Hugging Face config (config.json's fields),
    its image processor's settings, every sample's images (width, height in px) -> their items as
    that processor makes them (native resolution: the patch grid (rows, columns); tiles: how many),
    the sequence length and batch; `tokens`: special tokens the family's image tags need from a
    tokenizer (InternVL's <img>, </img>) -> their ids."""

    model_type: str
    config: dict
    processor: dict
    images: dict
    seq_length: int
    global_batch: int
    micro_batch: int
    tokens: dict = field(default_factory=dict)

    def sample_images(self, count: int = 0) -> tuple[tuple[int, int], ...]:
        """A sample's images (width, height): the preset's, cycled to `count` (0: the preset's own)."""
        sizes = tuple(self.images)
        return tuple(sizes[i % len(sizes)] for i in range(count or len(sizes)))

    def workload(self, llm_layers: int = 0, seq_length: int = 0, images: tuple = ()) -> Workload:
        """The planner's shapes: the family's vision tower as it runs (module docstring) on `images`
        (sizes among the preset's; default the preset's own) and its LLM at depth `llm_layers` (0:
        the config's) and `seq_length` (0: the preset's)."""
        items = [self.images[size] for size in images or self.sample_images()]
        vision = VISION_SHAPES[self.model_type](self.config, items)
        llm = llm_shape(self.config["text_config"], llm_layers, seq_length or self.seq_length)
        return Workload((vision,), llm, global_batch=self.global_batch, micro_batch=self.micro_batch)


def llm_shape(text: dict, layers: int, seq_length: int) -> ModuleShape:
    """A Qwen2 / Qwen3 / Qwen3-MoE text config's LLM (SwiGLU, GQA, head_dim where given)."""
    return ModuleShape("llm", "llm", hidden=text["hidden_size"], layers=layers or text["num_hidden_layers"],
                       heads=text["num_attention_heads"], kv_heads=text["num_key_value_heads"],
                       ffn=text.get("moe_intermediate_size", text["intermediate_size"]), gated_mlp=True,
                       seq_length=seq_length, vocab=text["vocab_size"], experts=text.get("num_experts", 0),
                       topk=text.get("num_experts_per_tok", 0), head_dim=text.get("head_dim", 0))


def _native_vision(v: dict, grids: list[tuple[int, int]], gated: bool, keys: float, deepstack: int) -> ModuleShape:
    """A native-resolution Qwen tower: each image's h*w patches (C x T x P x P values each) through
    the layers, h*w / merge^2 rows through the merger's MLP (width merge^2 x hidden)."""
    # Whole rows per image on average (so that a count of images other than the preset's averages to
    # whole merged rows), each of merge^2 patches.
    merge = v["spatial_merge_size"]
    tokens = sum(h * w for h, w in grids) // merge**2 // len(grids) * merge**2
    return ModuleShape("vision", "encoder", hidden=v["hidden_size"], layers=v["depth"], heads=v["num_heads"],
                       ffn=v["intermediate_size"], gated_mlp=gated, tokens_per_item=tokens,
                       items_per_sample=len(grids), output_tokens_per_item=tokens // merge**2,
                       projector_ffn=v["hidden_size"] * merge**2, attention_keys=keys,
                       patch_dim=3 * v["temporal_patch_size"] * v["patch_size"] ** 2, deepstack=deepstack,
                       cp_split="blocks")


def qwen2_5_vl_vision(config: dict, grids: list) -> ModuleShape:
    """Qwen2.5-VL's tower on images of these patch grids: SwiGLU, windows of window_size px in all
    but the full-attention layers."""
    v = config["vision_config"]
    keys = window_attention_keys(grids, v["window_size"] // v["patch_size"], v["spatial_merge_size"],
                                 len(v["fullatt_block_indexes"]), v["depth"])
    return _native_vision(v, grids, True, keys, 0)


def qwen3_vl_vision(config: dict, grids: list) -> ModuleShape:
    """Qwen3-VL's tower on images of these patch grids: GELU MLPs, each image attending within
    itself, DeepStack mergers."""
    v = config["vision_config"]
    return _native_vision(v, grids, False, item_attention_keys(grids), len(v["deepstack_visual_indexes"]))


def internvl_vision(config: dict, tiles: list) -> ModuleShape:
    """InternVL's InternViT on images of these tile counts: every tile's patches and class token
    through the layers, pixel shuffle (1 / downsample_ratio patches a side into one row) into the
    projector of the LLM's width."""
    v, shuffle = config["vision_config"], round(1 / config.get("downsample_ratio", 0.5))
    patches = (v["image_size"] // v["patch_size"]) ** 2
    return ModuleShape("vision", "encoder", hidden=v["hidden_size"], layers=v["num_hidden_layers"],
                       heads=v["num_attention_heads"], ffn=v["intermediate_size"], tokens_per_item=patches,
                       class_tokens=1, items_per_sample=sum(tiles),
                       output_tokens_per_item=patches // shuffle**2, projector_ffn=config["text_config"]["hidden_size"],
                       patch_dim=3 * v["patch_size"] ** 2, cp_split="none")


VISION_SHAPES = {"qwen2_5_vl": qwen2_5_vl_vision, "qwen3_vl": qwen3_vl_vision, "qwen3_vl_moe": qwen3_vl_vision,
                 "internvl": internvl_vision}

FAMILY_BENCHES = {
    "qwen2_5_vl_7b": FamilyBench("qwen2_5_vl", QWEN2_5_VL_7B, QWEN2_5_VL_PROCESSOR, QWEN_IMAGES, 8192, 4, 1),
    "qwen2_5_vl_tiny": FamilyBench("qwen2_5_vl", QWEN2_5_VL_TINY, QWEN2_5_VL_PROCESSOR, QWEN_TINY_IMAGES, 256, 4, 1),
    "internvl3_8b": FamilyBench("internvl", INTERNVL3_8B, INTERNVL_PROCESSOR, INTERNVL_IMAGES, 8192, 4, 1,
                                INTERNVL_TOKENS),
    "internvl_tiny": FamilyBench("internvl", INTERNVL_TINY, INTERNVL_TINY_PROCESSOR, INTERNVL_TINY_IMAGES, 256, 4, 1,
                                 INTERNVL_TINY_TOKENS),
    "qwen3_vl_8b": FamilyBench("qwen3_vl", QWEN3_VL_8B, QWEN3_VL_PROCESSOR, QWEN3_IMAGES, 8192, 4, 1),
    "qwen3_vl_tiny": FamilyBench("qwen3_vl", QWEN3_VL_TINY, QWEN3_TINY_PROCESSOR, QWEN3_TINY_IMAGES, 256, 4, 1),
    "qwen3_vl_30b_a3b": FamilyBench("qwen3_vl_moe", QWEN3_VL_30B_A3B, QWEN3_VL_PROCESSOR, QWEN3_IMAGES, 8192, 4, 1),
    "qwen3_vl_moe_tiny": FamilyBench("qwen3_vl_moe", QWEN3_VL_MOE_TINY, QWEN3_TINY_PROCESSOR, QWEN3_TINY_IMAGES, 256,
                                     4, 1),
}
