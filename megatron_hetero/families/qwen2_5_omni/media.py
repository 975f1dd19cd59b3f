"""Qwen2.5-Omni's images and audios for conversation data. Images as Qwen2.5-VL's (its image
processor, `<|vision_start|><|IMAGE|>*N<|vision_end|>`; families/qwen2_5_vl/media.py), their M-RoPE
positions transformers' get_rope_index's (an image's temporal ids are 0: the same as Qwen2.5-VL's).
An audio's tag becomes `<|audio_bos|>`, one `<|AUDIO|>` per row of the audio encoder, `<|audio_eos|>`;
its features are the family's feature extractor's (WhisperFeatureExtractor, called as
Qwen2_5OmniProcessor calls it: padded to its 30 s, the valid frames kept) of the file's audio, decoded
and resampled to the extractor's rate (data/audio.py); audio tokens count on all three position ids
as text does. A video's tag becomes `<|vision_start|><|VIDEO|>*N<|vision_end|>`, its frames as
Qwen2.5-VL's video processor makes them (families/qwen2_5_vl/video.py), its temporal position ids
stepping by position_id_per_seconds x the seconds per temporal patch, which Qwen2_5OmniProcessor sets
from the video processor's fps setting (2 without one), not the video's own rate; the text after an
image or a video continues after its largest position id (the thinker's get_rope_index). A video's
own audio track is not taken (`load_audio_from_video`)."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_hetero.convert.rules import HFMappingError
from megatron_hetero.data.audio import AudioInfo, read_audio
from megatron_hetero.data.media import ImageItems, ImageTokens, VideoItems
from megatron_hetero.data.sample_batch import Media
from megatron_hetero.data.video import VideoInfo
from megatron_hetero.families.qwen2_5_omni.audio import output_lengths
from megatron_hetero.families.qwen2_5_vl import media as qwen_vl_media
from megatron_hetero.families.qwen2_5_vl.video import QwenVideos, VideoSettings
from megatron_hetero.families.qwen2_5_vl.vision import QwenVisionArch
from megatron_hetero.models.mrope import grid_positions

FEATURES_KEY = "audio"  # processor settings: the feature extractor's
# processor settings: true, a video's own audio track is loaded with it (Qwen2_5OmniProcessor's flag)
LOAD_AUDIO_FROM_VIDEO = "load_audio_from_video"


def _feature_extractor_class():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor


def processor_settings(model_dir: str, config) -> dict:
    """The image and video processors' settings (Qwen2.5-VL's reader, on the thinker's config) and under "audio"
    the feature extractor's (preprocessor_config.json's, else transformers' defaults at the audio
    encoder's mel bins), checked against the audio encoder."""
    thinker = config.thinker_config
    settings = qwen_vl_media.processor_settings(model_dir, thinker)
    cls, mel_bins = _feature_extractor_class(), thinker.audio_config.num_mel_bins
    if Path(model_dir, qwen_vl_media.PROCESSOR_FILE).is_file():
        extractor = cls.from_pretrained(model_dir)
    else:
        extractor = cls(feature_size=mel_bins)
    if extractor.feature_size != mel_bins:
        raise HFMappingError(f"{model_dir}: the feature extractor's feature_size {extractor.feature_size} differs "
                             f"from thinker_config.audio_config.num_mel_bins {mel_bins}")
    return {**settings, FEATURES_KEY: json.loads(extractor.to_json_string()), LOAD_AUDIO_FROM_VIDEO: False}


def token_ids(config: dict) -> dict:
    """The thinker's special token ids under Qwen2.5-VL's names (its config writes *_index)."""
    thinker = config["thinker_config"]
    ids = {name: thinker.get(name, thinker.get(name.replace("_id", "_index")))
           for name in ("image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id",
                        "vision_end_token_id", "audio_start_token_id", "audio_end_token_id")}
    return {**ids, **{key: thinker[key] for key in ("position_id_per_seconds", "seconds_per_chunk") if key in thinker}}


class OmniVideos(QwenVideos):
    """Qwen2_5OmniProcessor's videos: the temporal step is position_id_per_seconds x temporal patch /
    the video processor's fps setting (`default_fps` where it has none)."""

    default_fps = 2.0

    def __init__(self, settings: VideoSettings, config: dict):
        super().__init__(settings, config)
        self.tokens_per_second = config["position_id_per_seconds"]

    @property
    def seconds_per_grid(self) -> float:
        return self.settings.temporal_patch_size / (self.settings.fps or self.default_fps)

    def timing(self, info: VideoInfo, frames: list[int], grid: tuple[int, int, int]) -> dict:
        return {**super().timing(info, frames, grid), "seconds_per_grid": self.seconds_per_grid}


@dataclass(frozen=True)
class VideoWithAudio(VideoItems):
    """A video's item whose tag expands to its rows interleaved with its own audio's `audio_rows`."""

    audio_rows: int = 0


def _processor_chunks(values, per_chunk: int) -> list[tuple[int, int]]:
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

    return Qwen2_5OmniProcessor.get_chunked_index(None, values, per_chunk)


def _model_chunks(values, per_chunk: int) -> list[tuple[int, int]]:
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniPreTrainedModelForConditionalGeneration as Thinker,
    )

    return Thinker.get_chunked_index(None, values, per_chunk, 0)


def _chunks(video, audio, per_chunk: int, chunked) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per chunk of `per_chunk` position ids, the (start, end) of the video's tokens and the audio's
    in it (transformers' chunking: `chunked`, the processor's on the tokens' times, the model's on
    their temporal ids; a side without tokens left gives empty ranges)."""
    v, a = chunked(video, per_chunk), chunked(audio, per_chunk)
    empty = ((len(video), len(video)), (len(audio), len(audio)))
    return [(v[j] if j < len(v) else empty[0], a[j] if j < len(a) else empty[1]) for j in range(max(len(v), len(a)))]


class OmniMedia(qwen_vl_media.QwenImages):
    """See the module docstring. settings: model.json's "processor" (with "load_audio_from_video":
    true, a video's tag expands to its frames and its own audio track, interleaved by time); config:
    its Hugging Face config."""

    media_kinds = ("image", "video", "audio")
    videos_class = OmniVideos
    # how the family's processor calls the feature extractor: padded to its 30 s, the valid frames kept
    extractor_call = dict(padding="max_length")

    def __init__(self, arch: QwenVisionArch, settings: dict, config: dict):
        settings = dict(settings)
        features = settings.pop(FEATURES_KEY)
        self.load_audio_from_video = bool(settings.pop(LOAD_AUDIO_FROM_VIDEO, False))
        self.ids = ids = token_ids(config)
        super().__init__(arch, settings, ids, self.videos_class)
        self.extractor = _feature_extractor_class().from_dict(features)
        self.audio_tokens = ImageTokens((ids["audio_start_token_id"],), ids["audio_token_id"],
                                        (ids["audio_end_token_id"],))

    # ---- audio -------------------------------------------------------------------------------------
    def audio_items(self, info: AudioInfo) -> ImageItems:
        """An audio's item: its feature frames (as the extractor's attention mask counts them, at most
        its 30 s) as the grid (1, 1, frames), output_lengths(frames) rows."""
        frames = self.audio_frames(info.samples)
        rows = self.audio_rows(frames)
        t = self.audio_tokens
        return ImageItems((rows,), (frames,), ((1, 1, frames),), ((*t.prefix, *[t.placeholder] * rows, *t.suffix),))

    def audio_frames(self, samples: int) -> int:
        """The feature frames of an audio of `samples` samples (the extractor's attention mask)."""
        return min(-(-samples // self.extractor.hop_length), self.extractor.nb_max_frames)

    def audio_rows(self, frames: int) -> int:
        """The rows the audio encoder sends for an audio of `frames` feature frames."""
        return int(output_lengths(torch.tensor(frames)))

    @property
    def tokens_per_chunk(self) -> int:
        """The position ids of one chunk of a video with its audio (seconds_per_chunk)."""
        return int(self.ids["position_id_per_seconds"] * self.ids["seconds_per_chunk"])

    def audio_info(self, source) -> AudioInfo:
        return AudioInfo(len(read_audio(source, self.extractor.sampling_rate)))

    def audio_pixels(self, source, items: ImageItems) -> torch.Tensor:
        """The audio's features [frames, mel bins]; raises AudioError."""
        waveform = read_audio(source, self.extractor.sampling_rate)
        out = self.extractor(waveform, sampling_rate=self.extractor.sampling_rate, **self.extractor_call,
                             return_attention_mask=True, return_tensors="pt")
        frames = int(out["attention_mask"].sum())
        return out["input_features"][0, :, :frames].T.contiguous()

    # ---- positions and a video's own audio ---------------------------------------------------------
    def position_ids(self, seq_len: int, starts: list[int], items: list[ImageItems]) -> torch.Tensor:
        """[3, seq_len] as the thinker's get_rope_index: text counting up on all three ids, an item's
        block placed after the text before it, the text after it continuing from the block's largest
        id plus one (a video's temporal ids included). starts: the runs of vision placeholders (a
        video with its audio has several: its block begins at the first)."""
        positions = torch.empty(3, seq_len, dtype=torch.long)
        reached = done = 0  # the next position id; the tokens placed
        runs = iter(starts)
        for item in items:
            start = next(run for run in runs if run >= done)
            block, lead, after = self._block(item)
            start -= lead
            positions[:, done:start] = torch.arange(start - done) + reached
            reached += start - done
            positions[:, start : start + block.shape[1]] = block + reached
            reached += after
            done = start + block.shape[1]
        positions[:, done:] = torch.arange(seq_len - done) + reached
        return positions

    def _times(self, item: VideoItems, t: int) -> torch.Tensor:
        """A video's temporal ids as the thinker computes them (its step's factors in its order)."""
        seconds = torch.tensor(item.seconds_per_grid, dtype=torch.float32)
        return (torch.arange(t) * seconds * self.videos.tokens_per_second).long()

    def _block(self, item: ImageItems) -> tuple[torch.Tensor, int, int]:
        """(position ids [3, tokens] of an item's block from 0, the tokens before its first vision
        placeholder, the id the text after it starts from): an image's or a video's grid, the text
        after its largest id; a video with its audio (VideoWithAudio) from its <|vision_start|>: the
        two starts at 0, the video's and the audio's chunks (ids from 1) in the thinker's order, the
        two ends after the last chunk's largest id, as the thinker places them."""
        (t, h, w), merge = item.grids[0], self.arch.spatial_merge_size
        times = torch.zeros(t, dtype=torch.long) if not isinstance(item, VideoItems) else self._times(item, t)
        grid = grid_positions(times, h, w, merge)
        if not isinstance(item, VideoWithAudio):
            return grid, 0, int(grid.max()) + 1
        return self._interleaved_block(item, grid)

    def _interleaved_block(self, item: "VideoWithAudio", grid: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """_block of a video with its audio: chunk by chunk (module docstring)."""
        audio = torch.arange(item.audio_rows).expand(3, -1)
        chunks = _chunks(grid[0], audio[0], self.tokens_per_chunk, _model_chunks)
        parts = [part[:, a:b] + 1 for (v, c) in chunks for part, (a, b) in ((grid, v), (audio, c)) if b > a]
        end = int(parts[-1].max()) + 1
        return torch.cat([torch.zeros(3, 2, dtype=torch.long), *parts, torch.full((3, 2), end)], 1), 2, end + 1

    def with_audio(self, video: VideoItems, audio: ImageItems) -> "VideoWithAudio":
        """A video's item whose tag expands to its frames' rows interleaved with its own audio's, chunk
        by chunk of seconds_per_chunk (Qwen2_5OmniProcessor's replace_video_with_audio_token): its
        <|vision_start|>, <|audio_bos|>, per chunk the video's <|VIDEO|> then the audio's <|AUDIO|>,
        <|audio_eos|>, <|vision_end|>."""
        (t, h, w), merge = video.grids[0], self.arch.spatial_merge_size
        per_frame = h * w // merge**2
        times = np.repeat(np.arange(t), per_frame) * video.seconds_per_grid * self.videos.tokens_per_second
        rows = audio.rows[0]
        pads = self._interleaved_pads(times, rows)
        ids = (self.videos.start, *self.audio_tokens.prefix, *pads, *self.audio_tokens.suffix, self.videos.end)
        return VideoWithAudio(**{**asdict(video), "expansion": (ids,)}, audio_rows=rows)

    def _interleaved_pads(self, times: np.ndarray, rows: int) -> list[int]:
        """The video's and its audio's placeholders in order, of video tokens at position ids `times`
        and `rows` audio tokens: chunk by chunk, the video's then the audio's."""
        chunks = _chunks(times, np.arange(rows), self.tokens_per_chunk, _processor_chunks)
        return [token for v, c in chunks for token, (a, b) in ((self.videos.pad, v), (self.audio_tokens.placeholder, c))
                for _ in range(b - a)]

    def audio_media(self, audios: list[ImageItems], positions: torch.Tensor) -> Media:
        grids = torch.tensor([g for a in audios for g in a.grids], dtype=torch.long).reshape(-1, 3)
        return Media(torch.full((int(grids[:, 2].sum()), self.extractor.feature_size), torch.nan),
                     torch.tensor([len(grids)]), positions, grids,
                     torch.tensor([r for a in audios for r in a.rows], dtype=torch.long))

    def hf_inputs(self, input_ids: torch.Tensor, media: Media, items: list[ImageItems],
                  audio: Media | None = None) -> dict:
        """transformers' thinker's forward arguments beside input_ids: the images' (Qwen2.5-VL's,
        without the token types the thinker does not take), the audios' features [audios, mel,
        frames] with their frames' mask, and an attention mask of ones (without one the thinker
        computes no M-RoPE positions)."""
        out = super().hf_inputs(input_ids, media, items)
        out.pop("mm_token_type_ids")
        out["attention_mask"] = torch.ones_like(input_ids)
        if "second_per_grid_ts" in out:  # the thinker's name for it
            out["video_second_per_grid"] = out.pop("second_per_grid_ts")
        if any(isinstance(item, VideoWithAudio) for item in items):
            out["use_audio_in_video"] = True
        if audio is None or not len(audio.grids):
            return out
        frames = audio.grids[:, 2]
        longest = int(frames.max())
        features = torch.zeros(len(frames), self.extractor.feature_size, longest)
        for i, part in enumerate(audio.items.split(frames.tolist())):
            features[i, :, : len(part)] = part.T
        mask = (torch.arange(longest) < frames[:, None]).long()
        return {**out, "input_features": features, "feature_attention_mask": mask}


def build_media(sizes, settings: dict, config: dict) -> OmniMedia:
    return OmniMedia(QwenVisionArch.of(sizes), settings, config)
