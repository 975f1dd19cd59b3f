"""Qwen3-Omni's images, videos and audios for conversation data: Qwen2.5-Omni's (families/qwen2_5_omni/
media.py: transformers' Qwen2-VL image and video processors, the thinker's M-RoPE positions, audio
tokens counting like text) at Qwen3-Omni's patch sizes, with Qwen3OmniMoeProcessor's differences:
- audio features by the WhisperFeatureExtractor called as the processor calls it (`padding=True`, no
  truncation: the whole audio, no 30 s cap), samples // hop frames; an audio of F frames sends
  transformers' _get_feat_extract_output_lengths(F) rows (13 per whole chunk of 2 x n_window frames);
- a video's seconds per temporal patch are temporal_patch_size / the video processor's fps setting
  (1 without one, the processor's default); its temporal position ids step by position_id_per_seconds
  x that, which must be whole (the thinker's ids are floats; ours are integers);
- a video with its own audio (`load_audio_from_video`): `<|vision_start|><|audio_start|>`, the
  video's and the audio's placeholders merged by time (a video token at its temporal position id
  goes before the audio tokens from that id on: replace_video_with_audio_token), `<|audio_end|>
  <|vision_end|>`; positions as the thinker's get_rope_index places them: the two starts count on,
  each token at its own id (a video token its grid's, an audio token its index) from there, the two
  ends after the last piece's largest id."""

import numpy as np
import torch

from megatron_hetero.convert.rules import HFMappingError
from megatron_hetero.data.audio import AudioError
from megatron_hetero.families.qwen2_5_omni import media as omni_media
from megatron_hetero.families.qwen2_5_omni.media import OmniMedia, OmniVideos, VideoWithAudio
from megatron_hetero.families.qwen2_5_vl.video import VideoSettings
from megatron_hetero.families.qwen3_vl.vision import Qwen3VisionArch


class Qwen3OmniVideos(OmniVideos):
    """Qwen3OmniMoeProcessor's videos: Qwen2.5-Omni's with the processor's default fps of 1."""

    default_fps = 1.0

    def __init__(self, settings, config: dict):
        super().__init__(settings, config)
        step = self.seconds_per_grid * self.tokens_per_second
        if step != int(step):
            raise HFMappingError(f"the video processor's fps {settings.fps} gives temporal position ids "
                                 f"{step:g} apart (temporal_patch_size / fps x position_id_per_seconds), "
                                 f"not a whole number; set its fps so that they are")


def output_lengths(frames, n_window: int):
    """transformers' _get_feat_extract_output_lengths: an audio's rows from its feature frames."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    return _get_feat_extract_output_lengths(frames, n_window)


class Qwen3OmniMedia(OmniMedia):
    """See the module docstring."""

    videos_class = Qwen3OmniVideos
    extractor_call = dict(padding=True, truncation=False)

    def __init__(self, arch: Qwen3VisionArch, settings: dict, config: dict, n_window: int):
        super().__init__(arch, settings, config)
        self.n_window = n_window

    def audio_frames(self, samples: int) -> int:
        frames = samples // self.extractor.hop_length
        if not frames:
            raise AudioError(f"corrupt audio ({samples} samples: shorter than one feature frame)")
        return frames

    def audio_rows(self, frames: int) -> int:
        return int(output_lengths(torch.tensor(frames), self.n_window))

    @staticmethod
    def _merged(video: np.ndarray, rows: int) -> np.ndarray:
        """The order of a video's tokens (at temporal ids `video`) and `rows` audio tokens (at ids
        0, 1, ...) merged by id, the video's first on a tie: indices into [video tokens, audio tokens]."""
        return np.lexsort((np.r_[np.zeros(len(video)), np.ones(rows)], np.r_[video, np.arange(rows)]))

    def _interleaved_pads(self, times: np.ndarray, rows: int) -> list[int]:
        return [self.videos.pad if k < len(times) else self.audio_tokens.placeholder
                for k in self._merged(times, rows)]

    def _interleaved_block(self, item: VideoWithAudio, grid: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        order = self._merged(grid[0].numpy(), item.audio_rows)
        audio = torch.arange(item.audio_rows).expand(3, -1)
        stream = torch.cat([grid, audio], 1)[:, torch.from_numpy(order)] + 2
        # get_rope_index goes on from its last piece: the final run of one side's tokens
        audio_token = order >= grid.shape[1]
        differs = np.flatnonzero(audio_token != audio_token[-1])
        end = int(stream[:, differs[-1] + 1 if len(differs) else 0 :].max()) + 1
        ends = torch.tensor([end, end + 1]).expand(3, -1)
        return torch.cat([torch.arange(2).expand(3, -1), stream, ends], 1), 2, end + 2


def processor_settings(model_dir: str, config) -> dict:
    """Qwen2.5-Omni's settings reader (image and video processors, feature extractor), the videos'
    temporal step checked at import."""
    settings = omni_media.processor_settings(model_dir, config)
    Qwen3OmniVideos(VideoSettings.of(settings["video"]), omni_media.token_ids(config.to_dict()))
    return settings


def build_media(sizes, settings: dict, config: dict) -> Qwen3OmniMedia:
    return Qwen3OmniMedia(Qwen3VisionArch.of(sizes), settings, config, sizes.family_arch["audio_n_window"])
