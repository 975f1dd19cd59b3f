"""Qwen3-Omni's audio encoder in megatron-core terms, under the encoder's own TP group.

An audio arrives as its log-mel features [frames, mel bins] (media.py), its grid (1, 1, frames). Each
audio is cut into chunks of 2 x n_window frames (the last shorter); each chunk, zero-padded to 2 x
n_window frames, goes through three 2D convolutions over (mel, time) (kernel 3, stride 2, GELU) and
a linear map of their channels x mel bins (`conv_out`), with sinusoidal positions counted from the
chunk's start; a chunk keeps the rows of its own frames (transformers' _get_feat_extract_output_lengths).
The layers (Qwen2.5-Omni's: LayerNorm, attention with biases on q, k and v, GELU MLP) attend within
windows of n_window_infer / (2 x n_window) whole chunks' rows of an audio (SegmentAttention over
their cu_seqlens); then `ln_post`, `proj1`, the activation and `proj2` into the LLM's width:
transformers' Qwen3OmniMoeAudioEncoder. transformers pads a batch's chunks to its longest and runs
its convolutions over that padding unmasked, so the last rows of an audio shorter than one chunk
depend on what else is in its batch: each audio here is convolved as transformers convolves it
alone (its chunks padded to its longest, zeros past that after every convolution), so its rows are
its own whatever the batch, equal to transformers' for an audio alone or beside audios whose
chunks are as long (every audio of at least 2 x n_window frames). The front end and the head are
replicated over TP (small).

Output: rows [sum over audios of their rows, llm hidden * (1 + DeepStack blocks)]: the DeepStack
columns zero (the boundary moves one row width for every encoder of a DeepStack model; transformers
adds DeepStack rows only at visual positions, and zeros add nothing).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers.activations import ACT2FN

from megatron_hetero.families.qwen2_5_omni.audio import OmniAudioArch, audio_config, sinusoids
from megatron_hetero.families.qwen2_5_vl.vision import vision_layer_spec
from megatron_hetero.families.qwen3_omni.media import output_lengths
from megatron_hetero.models.specs import block_spec
from megatron_hetero.models.varlen import SegmentParams
from megatron_hetero.spec.sizes import stride2_sizes


@dataclass(frozen=True)
class Qwen3OmniAudioArch(OmniAudioArch):
    """Qwen2.5-Omni's audio sizes (family_arch audio_* keys) and Qwen3-Omni's front end and windows."""

    audio_n_window: int = 50
    audio_n_window_infer: int = 800
    audio_downsample_hidden_size: int = 480

    @property
    def window_rows(self) -> int:
        """The rows of one attention window: n_window_infer / (2 x n_window) whole chunks'."""
        chunk = 2 * self.audio_n_window
        return int(output_lengths(torch.tensor(chunk), self.audio_n_window)) * (self.audio_n_window_infer // chunk)


class Qwen3OmniAudioEncoder(MegatronModule):
    """features [frames, mel bins] of audios with grids [n, 3] (1, 1, frames) -> rows (module docstring)."""

    share_embeddings_and_output_weights = False

    def __init__(self, config: TransformerConfig, arch: Qwen3OmniAudioArch, mel_bins: int, zero_columns: int,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config=config)
        self.arch, self.zero_columns, hidden, dtype = arch, zero_columns, config.hidden_size, config.params_dtype
        channels = arch.audio_downsample_hidden_size
        self.conv2d1 = torch.nn.Conv2d(1, channels, 3, 2, padding=1, dtype=dtype)
        self.conv2d2 = torch.nn.Conv2d(channels, channels, 3, 2, padding=1, dtype=dtype)
        self.conv2d3 = torch.nn.Conv2d(channels, channels, 3, 2, padding=1, dtype=dtype)
        self.conv_out = torch.nn.Linear(channels * stride2_sizes(mel_bins, 3)[-1], hidden, bias=False, dtype=dtype)
        self.register_buffer("positions", sinusoids(arch.audio_max_source_positions, hidden), persistent=False)
        self.decoder = TransformerBlock(config=config, spec=block_spec(vision_layer_spec(pg_collection, None), config,
                                                                        pg_collection, te=False),
                                        pre_process=True, post_process=False, pg_collection=pg_collection)
        self.ln_post = torch.nn.LayerNorm(hidden, dtype=dtype)
        self.proj1 = torch.nn.Linear(hidden, hidden, dtype=dtype)
        self.activation = ACT2FN[arch.audio_activation]
        self.proj2 = torch.nn.Linear(hidden, arch.audio_output_dim, dtype=dtype)

    def _front(self, features: torch.Tensor, chunks: list[int], alone: torch.Tensor) -> torch.Tensor:
        """[chunks, rows of a whole chunk, hidden]: the chunks convolved as each one's audio alone
        pads them (to `alone` frames: its longest chunk), with their positions."""
        padded = torch.nn.utils.rnn.pad_sequence(features.split(chunks), batch_first=True)
        padded = F.pad(padded, (0, 0, 0, 2 * self.arch.audio_n_window - padded.shape[1]))
        x = padded.transpose(1, 2)[:, None]  # [chunks, 1, mel, frames]
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
            alone = (alone + 1) // 2  # each convolution's zero padding where the audio alone ends
            x = x * (torch.arange(x.shape[-1], device=x.device) < alone[:, None]).to(x.dtype)[:, None, None]
        x = self.conv_out(x.permute(0, 3, 1, 2).flatten(2))
        return x + self.positions[: x.shape[1]].to(x.dtype)

    def _windows(self, rows: torch.Tensor) -> torch.Tensor:
        """cu_seqlens of the attention windows: each audio's rows in windows of window_rows."""
        window = self.arch.window_rows
        lengths = [w for n in rows.tolist() for w in [window] * (n // window) + ([n % window] if n % window else [])]
        return torch.tensor([0, *lengths]).cumsum(0).int()

    def forward(self, features: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        frames = grids[:, 2].cpu()
        whole = 2 * self.arch.audio_n_window
        chunks = [min(whole, int(n) - at) for n in frames for at in range(0, int(n), whole)]
        alone = torch.tensor([min(whole, int(n)) for n in frames for _ in range(0, int(n), whole)])
        kept = output_lengths(torch.tensor(chunks), self.arch.audio_n_window)  # each chunk's own rows
        valid = (torch.arange(stride2_sizes(whole, 3)[-1]) < kept[:, None]).flatten().nonzero()[:, 0]
        windows = self._windows(output_lengths(frames, self.arch.audio_n_window))
        segments, (valid, alone) = SegmentParams.of(windows, None, features.device, [valid, alone])
        x = self._front(features, chunks, alone).flatten(0, 1).index_select(0, valid)
        x = self.decoder(x[:, None], attention_mask=None, packed_seq_params=segments)[:, 0]
        rows = self.proj2(self.activation(self.proj1(self.ln_post(x))))
        return F.pad(rows, (0, self.zero_columns))


def build_audio_encoder(sizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype = torch.float32,
                        whole: bool = False, **config_overrides) -> Qwen3OmniAudioEncoder:
    """The audio module on this rank (one pipeline stage), its rows as wide as the vision tower's."""
    from megatron_hetero.families import family_named

    arch = Qwen3OmniAudioArch.of(sizes)
    config = audio_config(sizes, tp, pgs, dtype, whole, arch, **config_overrides)
    zero_columns = sizes.hidden_size * len(family_named(sizes.family).deepstack(sizes))
    return Qwen3OmniAudioEncoder(config, arch, sizes.audio_mel_bins, zero_columns, pgs)
