"""Qwen2.5-Omni's audio encoder (Whisper-like) in megatron-core terms, under the encoder's own TP group.

An audio arrives as its log-mel features [frames, mel bins] (media.py: the family's feature
extractor), its grid (1, 1, frames). Each audio is cut into chunks of 2 x n_window frames (the last
shorter), each chunk through two convolutions (kernel 3; GELU; the second of stride 2) with
sinusoidal positions counted from the chunk's start; the layers (LayerNorm, attention with biases but
on the keys, GELU MLP) attend within a chunk (SegmentAttention over the chunks' cu_seqlens); then
each audio's tokens are averaged in pairs, normalized (`ln_post`) and projected to the LLM's width
(`proj`): transformers' Qwen2_5OmniAudioEncoder, its chunk plan from transformers' own functions.
The front end and the head are replicated over TP (small); every rank of the TP group computes them
alike.

Context parallelism: the encoder's CP ranks split each audio by its rows, rank c holding rows
[c*n//cp, (c+1)*n//cp) (the boundary's split of an item's rows) and so the two tokens each of them
averages (an odd last token, which no row takes but its chunk attends to, with the last row's);
every rank runs the front end on its audios' whole chunks (a few percent of the layers' work) and
keeps its tokens; in the layers each chunk's local queries attend to all of the chunk's keys,
gathered over the CP group (models/varlen.py: CPSplit), whichever ranks a chunk's tokens fall on:
the same outputs as on one rank.

Output: rows [sum over audios of ((frames - 1) // 2 + 1 - 2) // 2 + 1, llm hidden], audio by audio
(with CP: this rank's rows of each audio).
"""

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.families.qwen2_5_vl.vision import vision_layer_spec
from megatron_hetero.models.specs import block_spec
from megatron_hetero.models.varlen import CPSplit, SegmentParams, cp_owners
from megatron_hetero.spec.sizes import TransformerArch


@dataclass(frozen=True)
class OmniAudioArch:
    """ModelSizes.family_arch of the audio encoder (audio_* keys): beyond the audio_* sizes."""

    audio_ffn_hidden_size: int = 5120
    audio_activation: str = "gelu"
    audio_n_window: int = 100
    audio_max_source_positions: int = 1500
    audio_output_dim: int = 3584

    @classmethod
    def of(cls, sizes):
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in sizes.family_arch.items() if key in names})

    def transformer_arch(self) -> TransformerArch:
        return TransformerArch(ffn_hidden_size=self.audio_ffn_hidden_size, activation=self.audio_activation,
                               normalization="LayerNorm", norm_eps=1e-5, linear_bias=True)


def output_lengths(frames: torch.Tensor) -> torch.Tensor:
    """The rows an audio of `frames` feature frames sends into the LLM (transformers'
    _get_feat_extract_output_lengths)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's positions [length, channels] (transformers' SinusoidsPositionEmbedding)."""
    increment = torch.log(torch.tensor(max_timescale)).item() / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


def audio_split(frames: torch.Tensor, group) -> CPSplit:
    """This CP rank's part of packed audios of `frames` feature frames (the module docstring), one
    token a unit, in the tokens' order."""
    tokens = (frames - 1) // 2 + 1  # after the stride-2 convolution, the chunks back to back
    rows = output_lengths(frames).clamp(min=1)  # an audio too short for a row still has a token
    audio = torch.repeat_interleave(torch.arange(len(frames)), tokens)
    within = torch.arange(int(tokens.sum())) - (tokens.cumsum(0) - tokens)[audio]
    row = (rows.cumsum(0) - rows)[audio] + torch.minimum(within // 2, rows[audio] - 1)
    return CPSplit.owned(cp_owners(rows, group.size())[row], None, 1, group)


class OmniAudioEncoder(MegatronModule):
    """features [frames, mel bins] of audios with grids [n, 3] (1, 1, frames) -> rows [tokens, llm hidden]."""

    share_embeddings_and_output_weights = False

    def __init__(self, config: TransformerConfig, arch: OmniAudioArch, mel_bins: int,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config=config)
        self.arch, hidden, dtype = arch, config.hidden_size, config.params_dtype
        self.cp_group = pg_collection.cp  # its ranks split each audio (audio_split)
        self.conv1 = torch.nn.Conv1d(mel_bins, hidden, kernel_size=3, padding=1, dtype=dtype)
        self.conv2 = torch.nn.Conv1d(hidden, hidden, kernel_size=3, stride=2, padding=1, dtype=dtype)
        self.register_buffer("positions", sinusoids(arch.audio_max_source_positions, hidden), persistent=False)
        self.decoder = TransformerBlock(config=config, spec=block_spec(vision_layer_spec(pg_collection, None), config,
                                                                        pg_collection, te=False),
                                        pre_process=True, post_process=False, pg_collection=pg_collection)
        self.ln_post = torch.nn.LayerNorm(hidden, dtype=dtype)
        self.proj = torch.nn.Linear(hidden, arch.audio_output_dim, dtype=dtype)

    def forward(self, features: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            get_audio_cu_seqlens,
            get_pool_indices,
            get_valid_indices,
        )

        frames = grids[:, 2].cpu()
        window = 2 * self.arch.audio_n_window
        chunks = [min(window, int(n) - at) for n in frames for at in range(0, int(n), window)]
        chunk_lengths = torch.tensor(chunks)
        valid, pool, split = get_valid_indices(chunk_lengths), get_pool_indices(frames), None
        if self.cp_group is not None and self.cp_group.size() > 1:
            split = audio_split(frames, self.cp_group)
            mine = split.tokens(1)  # ascending: a row's two tokens are adjacent in it too
            valid, pool = valid[mine], torch.searchsorted(mine, pool[split.local[pool]])
        segments, (valid, pool) = SegmentParams.of(get_audio_cu_seqlens(chunk_lengths), None, features.device,
                                                   [valid, pool], split)
        padded = torch.nn.utils.rnn.pad_sequence(features.split(chunks), batch_first=True).transpose(1, 2)
        mask = (torch.arange(padded.shape[2]) < chunk_lengths[:, None]).to(features.device, features.dtype)
        x = F.gelu(self.conv1(padded)) * mask[:, None]
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = (x + self.positions[: x.shape[1]].to(x.dtype)).flatten(0, 1).index_select(0, valid)
        x = self.decoder(x[:, None], attention_mask=None, packed_seq_params=segments)[:, 0]
        return self.proj(self.ln_post((x[pool] + x[pool + 1]) / 2))


def audio_config(sizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype, whole: bool,
                 arch: OmniAudioArch, **config_overrides) -> TransformerConfig:
    """The layers' config of a family's audio encoder on this rank, which runs as one pipeline stage."""
    from megatron_hetero.models.vlm import transformer_config

    if not whole and pgs.pp.size() > 1:
        raise ValueError(f"the {sizes.family} audio encoder runs as one pipeline stage; set the audio module's pp: 1")
    return transformer_config(sizes.audio_hidden_size, sizes.audio_num_layers, sizes.audio_num_attention_heads,
                              tp, dtype, arch=arch.transformer_arch(), **config_overrides)


def build_audio_encoder(sizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype = torch.float32,
                        whole: bool = False, **config_overrides) -> OmniAudioEncoder:
    """The audio module on this rank (one pipeline stage)."""
    arch = OmniAudioArch.of(sizes)
    config = audio_config(sizes, tp, pgs, dtype, whole, arch, **config_overrides)
    return OmniAudioEncoder(config, arch, sizes.audio_mel_bins, pgs)
