"""Audio encoder: a 1D-convolution front end over spectrogram frames, learned positions, a
bidirectional TransformerBlock + MLP projector to the LLM hidden size, buildable as a pipeline stage
(see encoder.py)."""

import torch
from einops import rearrange
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models.encoder import StageEncoder
from megatron_hetero.spec.sizes import AUDIO_FRAMES_PER_TOKEN


class ConvFrontEnd(torch.nn.Sequential):
    """spectrograms [n, mel_bins, frames] in [0, 1] -> [frames / 4, n, hidden]: two convolutions
    over time (kernel 3, stride 2, GELU), the mel bins as input channels."""

    def __init__(self, mel_bins: int, hidden: int):
        super().__init__(
            torch.nn.Conv1d(mel_bins, hidden, kernel_size=3, stride=2, padding=1),
            torch.nn.GELU(),
            torch.nn.Conv1d(hidden, hidden, kernel_size=3, stride=2, padding=1),
            torch.nn.GELU(),
        )

    def forward(self, spectrograms: torch.Tensor) -> torch.Tensor:
        return rearrange(super().forward(spectrograms * 2 - 1), "n h t -> t n h")


class AudioEncoder(StageEncoder):
    """spectrograms [n, mel_bins, frames] -> rows [n * frames / 4, llm_hidden] on the last stage."""

    def __init__(
        self,
        config: TransformerConfig,
        projector_config: TransformerConfig,
        mel_bins: int,
        frames: int,
        pg_collection: ProcessGroupCollection,
        pre_process: bool = True,
        post_process: bool = True,
    ):
        if frames < AUDIO_FRAMES_PER_TOKEN or frames % AUDIO_FRAMES_PER_TOKEN:
            raise ValueError(f"audio frames {frames} is not a positive multiple of {AUDIO_FRAMES_PER_TOKEN}")
        super().__init__(
            config,
            projector_config,
            frames // AUDIO_FRAMES_PER_TOKEN,
            pg_collection,
            lambda: ConvFrontEnd(mel_bins, config.hidden_size),
            pre_process,
            post_process,
        )
