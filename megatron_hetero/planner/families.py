"""The VLM families' benchmark presets and their shapes as they run.

A family preset is a Hugging Face config (config.json's fields, the published model's sizes), its
image processor's settings and every sample's images; bench_e2e builds the family's own model from
it (random weights) and the planner counts it from the same numbers. A family's presets are data in
its own folder, families/<name>/presets.json, which this module reads (a file, not an import: the
planner sits below families/), so that a family's presets come with the family. Each preset names
the vision shape that counts what its tower computes (`vision_shape`, VISION_SHAPES):
- native_windowed (Qwen2.5-VL): native-resolution images, windowed attention in all but the full-attention layers
  (counts.window_attention_keys), SwiGLU MLPs, the 2x2 patch merger into the LLM;
- tiles (InternVL): fixed 448-px tiles plus InternViT's class token through the layers, pixel shuffle
  sending 1 row per 2x2 patches (256 of a tile's 1024) through the MLP projector (LayerNorm, Linear
  4h -> LLM hidden, GELU, Linear);
- native (Qwen3-VL): native-resolution images attending within themselves (no windows), GELU MLPs, the
  merger and one DeepStack merger of the same shape per DeepStack layer on every row;
the Qwen towers split an image over CP by whole merge blocks, InternViT does not (cp_split); a
video is one item of the native towers, its grid (t, h, w) of temporal patches each attending as an
image of h x w patches does (transformers' cu_seqlens repeat each frame's). A preset whose config
has an audio_config (an omni model's thinker) has a second encoder, `audio`, counted on its videos'
own audio tracks by the AUDIO_SHAPES entry it names (`audio_shape`): Qwen2.5-Omni's Whisper-like
encoder (qwen2_5_omni_audio) or Qwen3-Omni's with its 2D-convolution front end (qwen3_omni_audio).
The LLM from text_config: grouped-query attention with its own head size (Qwen3's 128 need not be
hidden / heads), SwiGLU, and for the MoE LLMs (Qwen3-VL-MoE's, Qwen3-Omni's) the top-k of its
experts per token.

Plain data and arithmetic (no transformers import): tests/test_family_flops.py checks each family's
count against the matmul FLOPs of its model's forward, and the image grids and tiles against the
families' processors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hetero.planner.counts import (
    QKV_VIEW_COPIES,
    item_attention_keys,
    packed_sdpa_copies,
    window_attention_keys,
    window_lengths,
)
from megatron_hetero.planner.shapes import ModuleShape, Workload
from megatron_hetero.spec.sizes import stride2_sizes


@dataclass(frozen=True)
class FamilyBench:
    """A VLM family's model as bench_e2e trains it: its Hugging Face config (config.json's fields),
    its image processor's settings, every sample's images (width, height in px) -> their items as
    that processor makes them (native resolution: the patch grid (rows, columns); tiles: how many),
    the sequence length and batch; `vision_shape`: the VISION_SHAPES entry counting its tower;
    `tokens`: special tokens the family's image tags need from a tokenizer (InternVL's <img>, </img>)
    -> their ids; `videos`: every sample's videos (width, height in px, seconds, frames per second)
    -> (the patch grid (t, h, w) its video processor makes, the feature frames of its own audio track
    that the family's feature extractor makes: 0 without one); `config_key`: the Hugging Face
    config's key that holds `config` (Qwen2.5-Omni's thinker_config; "": config is the whole)."""

    model_type: str
    vision_shape: str
    config: dict
    processor: dict
    images: dict
    seq_length: int
    global_batch: int
    micro_batch: int
    tokens: dict = field(default_factory=dict)
    plan: tuple[str, int] | None = None  # a plan_layout preset too: (its description, its GPUs)
    videos: dict = field(default_factory=dict)
    config_key: str = ""
    audio_shape: str = ""

    def sample_images(self, count: int = 0) -> tuple[tuple[int, int], ...]:
        """A sample's images (width, height): the preset's, cycled to `count` (0: the preset's own)."""
        return _cycled(tuple(self.images), count)

    def sample_videos(self, count: int = 0) -> tuple[tuple[int, int, float, float], ...]:
        """A sample's videos (width, height, seconds, fps): the preset's, cycled to `count`."""
        return _cycled(tuple(self.videos), count)

    def hf_config(self, llm_layers: int = 0) -> dict:
        """The Hugging Face config's fields (AutoConfig.for_model's), the LLM at depth `llm_layers`
        (0: the config's)."""
        text = {**self.config["text_config"], **({"num_hidden_layers": llm_layers} if llm_layers else {})}
        config = {**self.config, "text_config": text}
        return {self.config_key: config} if self.config_key else config

    def workload(self, llm_layers: int = 0, seq_length: int = 0, images: tuple = (), videos: tuple = ()) -> Workload:
        """The planner's shapes: the family's vision tower as it runs (module docstring) on `images`
        and `videos` (sizes among the preset's; default the preset's own), the audio encoder on
        those videos' audio tracks where the family has one, and its LLM at depth `llm_layers` (0:
        the config's) and `seq_length` (0: the preset's)."""
        images, videos = images or self.sample_images(), videos or self.sample_videos()
        items = [self.images[size] for size in images] + [self.videos[size][0] for size in videos]
        encoders = (VISION_SHAPES[self.vision_shape](self.config, items),)
        tracks = [self.videos[size][1] for size in videos if self.videos[size][1]]
        if tracks:
            encoders += (AUDIO_SHAPES[self.audio_shape](self.config, tracks),)
        text = self.config["text_config"]
        # Qwen3-VL's config keeps the flag at its top, Qwen2.5-Omni's thinker in its text config.
        tied = bool(text.get("tie_word_embeddings", self.config.get("tie_word_embeddings", False)))
        llm = llm_shape(text, llm_layers, seq_length or self.seq_length, tied)
        return Workload(encoders, llm, global_batch=self.global_batch, micro_batch=self.micro_batch)


def _cycled(sizes: tuple, count: int) -> tuple:
    """`sizes` repeated in turn to `count` of them (0: as they are; none: none)."""
    return tuple(sizes[i % len(sizes)] for i in range(count or len(sizes))) if sizes else ()


def _frames(grids: list[tuple[int, ...]]) -> list[tuple[int, int]]:
    """The (h, w) attention items of native-resolution grids: an image's (h, w), each of a video's t
    temporal patches (t, h, w)."""
    return [g[-2:] for g in grids for _ in range(g[0] if len(g) == 3 else 1)]


def llm_shape(text: dict, layers: int, seq_length: int, tied_embeddings: bool = False) -> ModuleShape:
    """A Qwen2 / Qwen3 / Qwen3-MoE text config's LLM (SwiGLU, GQA, head_dim where given)."""
    return ModuleShape("llm", "llm", hidden=text["hidden_size"], layers=layers or text["num_hidden_layers"],
                       tied_embeddings=tied_embeddings,
                       heads=text["num_attention_heads"], kv_heads=text["num_key_value_heads"],
                       ffn=text.get("moe_intermediate_size", text["intermediate_size"]), gated_mlp=True,
                       seq_length=seq_length, vocab=text["vocab_size"], experts=text.get("num_experts", 0),
                       topk=text.get("num_experts_per_tok", 0), head_dim=text.get("head_dim", 0))


def _native_vision(v: dict, grids: list[tuple[int, ...]], gated: bool, keys: float, deepstack: int,
                   segments: list[list[int]]) -> ModuleShape:
    """A native-resolution Qwen tower: each image's h*w patches (a video's t*h*w; C x T x P x P
    values each) through the layers, h*w / merge^2 rows through the merger's MLP (width merge^2 x
    hidden); `segments`: each layer's attention segments (counts.packed_sdpa_copies)."""
    # Whole rows per item on average (so that a count of items other than the preset's averages to
    # whole merged rows), each of merge^2 patches.
    merge = v["spatial_merge_size"]
    tokens = sum(math.prod(g) for g in grids) // merge**2 // len(grids) * merge**2
    return ModuleShape("vision", "encoder", hidden=v["hidden_size"], layers=v["depth"], heads=v["num_heads"],
                       ffn=v["intermediate_size"], gated_mlp=gated, tokens_per_item=tokens,
                       items_per_sample=len(grids), output_tokens_per_item=tokens // merge**2,
                       projector_ffn=v["hidden_size"] * merge**2, attention_keys=keys,
                       patch_dim=3 * v["temporal_patch_size"] * v["patch_size"] ** 2, deepstack=deepstack,
                       cp_split="blocks", packed_sdpa_copies=packed_sdpa_copies(segments),
                       packed_fa4_copies=QKV_VIEW_COPIES)


def qwen2_5_vl_vision(config: dict, grids: list) -> ModuleShape:
    """Qwen2.5-VL's tower on images (and videos) of these patch grids: SwiGLU, windows of window_size
    px in all but the full-attention layers."""
    v, frames = config["vision_config"], _frames(grids)
    window, full = v["window_size"] // v["patch_size"], len(v["fullatt_block_indexes"])
    keys = window_attention_keys(frames, window, v["spatial_merge_size"], full, v["depth"])
    segments = [[h * w for h, w in frames]] * full + [window_lengths(frames, window)] * (v["depth"] - full)
    return _native_vision(v, grids, True, keys, 0, segments)


def qwen3_vl_vision(config: dict, grids: list) -> ModuleShape:
    """Qwen3-VL's tower on images of these patch grids: GELU MLPs, each image attending within
    itself, DeepStack mergers."""
    v, frames = config["vision_config"], _frames(grids)
    return _native_vision(v, grids, False, item_attention_keys(frames), len(v["deepstack_visual_indexes"]),
                          [[h * w for h, w in frames]])


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
                       patch_dim=3 * v["patch_size"] ** 2, cp_split="none", layer_scale=True)


def qwen2_5_omni_audio(config: dict, frames: list[int]) -> ModuleShape:
    """Qwen2.5-Omni's Whisper-like audio encoder on audios of these feature frames
    (families/qwen2_5_omni/audio.py): each cut into chunks of 2 x n_window frames, both convolutions
    (kernel 3, the second of stride 2: mel bins x 3 and hidden x 3 inputs per output value) giving a
    token per two frames, the layers (GELU MLPs) attending within a chunk, every two tokens averaged
    into a row projected to the LLM's width (one linear of hidden inputs). A last chunk shorter than
    the others runs padded to their length through the convolutions: counted as its own length. CP
    splits an audio by rows, any number of them (cp_split "blocks")."""
    a = config["audio_config"]
    window, hidden = 2 * a["n_window"], a["d_model"]
    chunks = [(min(window, n - at) - 1) // 2 + 1 for n in frames for at in range(0, n, window)]
    rows = sum(((n - 1) // 2 + 1 - 2) // 2 + 1 for n in frames) // len(frames)
    return ModuleShape("audio", "encoder", hidden=hidden, layers=a["encoder_layers"],
                       heads=a["encoder_attention_heads"], ffn=a["encoder_ffn_dim"], tokens_per_item=2 * rows,
                       items_per_sample=len(frames), output_tokens_per_item=rows, projector_input=hidden,
                       attention_keys=sum(c * c for c in chunks) / sum(chunks),
                       patch_dim=3 * hidden + 2 * 3 * a["num_mel_bins"], cp_split="blocks")


def qwen3_omni_audio(config: dict, frames: list[int]) -> ModuleShape:
    """Qwen3-Omni's audio encoder on audios of these feature frames (families/qwen3_omni/audio.py):
    each cut into chunks of 2 x n_window frames, every chunk padded to a whole one through three
    stride-2 3 x 3 convolutions over (mel, time) (1 -> C, C -> C, C -> C channels) and `conv_out` (C x
    the mel bins left -> hidden) on each of its rows; the layers (GELU MLPs) on the rows an audio
    keeps (a whole chunk's 13, a last chunk's by its own length), attending within windows of
    n_window_infer / (2 x n_window) chunks' rows; `proj1` (hidden -> hidden) and `proj2` (hidden ->
    the LLM's width) on every row. CP does not split an audio (the family refuses it)."""
    a = config["audio_config"]
    window, hidden, channels = 2 * a["n_window"], a["d_model"], a["downsample_hidden_size"]
    mels, times = stride2_sizes(a["num_mel_bins"], 3), stride2_sizes(window, 3)
    chunk_macs = (9 * channels * (mels[0] * times[0] + channels * (mels[1] * times[1] + mels[2] * times[2]))
                  + times[2] * channels * mels[2] * hidden)
    rows = [n // window * times[2] + (stride2_sizes(n % window, 3)[2] if n % window else 0) for n in frames]
    window_rows = times[2] * (a["n_window_infer"] // window)
    windows = [min(window_rows, n - at) for n in rows for at in range(0, n, window_rows)]
    chunks = sum(-(-n // window) for n in frames)
    return ModuleShape("audio", "encoder", hidden=hidden, layers=a["encoder_layers"],
                       heads=a["encoder_attention_heads"], ffn=a["encoder_ffn_dim"],
                       tokens_per_item=sum(rows) // len(rows), items_per_sample=len(frames),
                       projector_ffn=hidden, projector_input=hidden,
                       attention_keys=sum(w * w for w in windows) / sum(windows),
                       front_params=9 * channels * (1 + 2 * channels) + channels * mels[2] * hidden,
                       front_macs_per_item=chunks * chunk_macs / len(frames), cp_split="none")


VISION_SHAPES = {"native_windowed": qwen2_5_vl_vision, "native": qwen3_vl_vision, "tiles": internvl_vision}
AUDIO_SHAPES = {"whisper": qwen2_5_omni_audio, "conv2d": qwen3_omni_audio}
# The families' presets files (families/<name>/presets.json), in folder order.
PRESET_FILES = sorted((Path(__file__).parents[1] / "families").glob("*/presets.json"))


def _family_bench(entry: dict) -> FamilyBench:
    """A presets.json entry: images as [[width, height], item] pairs (item: a patch grid or a tile
    count), videos as [[width, height, seconds, fps], [[t, h, w], audio frames]]."""
    images = {tuple(size): tuple(item) if isinstance(item, list) else item for size, item in entry.get("images", [])}
    videos = {tuple(size): (tuple(grid), frames) for size, (grid, frames) in entry.get("videos", [])}
    plan = entry.get("plan")
    return FamilyBench(entry["model_type"], entry["vision_shape"], entry["config"], entry["processor"], images,
                       entry["seq_length"], entry["global_batch"], entry["micro_batch"], entry.get("tokens", {}),
                       (plan["description"], plan["gpus"]) if plan else None, videos, entry.get("config_key", ""),
                       entry.get("audio_shape", ""))


FAMILY_BENCHES = {name: _family_bench(entry) for path in PRESET_FILES
                  for name, entry in json.loads(path.read_text()).items()}
