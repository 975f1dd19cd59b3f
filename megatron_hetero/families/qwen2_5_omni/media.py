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
from pathlib import Path

import torch

from megatron_hetero.convert.rules import HFMappingError
from megatron_hetero.data.audio import AudioInfo, read_audio
from megatron_hetero.data.media import ImageItems, ImageTokens
from megatron_hetero.data.sample_batch import Media
from megatron_hetero.data.video import VideoInfo
from megatron_hetero.families.qwen2_5_omni.audio import output_lengths
from megatron_hetero.families.qwen2_5_vl import media as qwen_vl_media
from megatron_hetero.families.qwen2_5_vl.video import QwenVideos, VideoSettings
from megatron_hetero.families.qwen2_5_vl.vision import QwenVisionArch

FEATURES_KEY = "audio"  # processor settings: the feature extractor's


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
    return {**settings, FEATURES_KEY: json.loads(extractor.to_json_string())}


def token_ids(config: dict) -> dict:
    """The thinker's special token ids under Qwen2.5-VL's names (its config writes *_index)."""
    thinker = config["thinker_config"]
    ids = {name: thinker.get(name, thinker.get(name.replace("_id", "_index")))
           for name in ("image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id",
                        "vision_end_token_id", "audio_start_token_id", "audio_end_token_id")}
    return {**ids, "position_id_per_seconds": thinker["position_id_per_seconds"]}


class OmniVideos(QwenVideos):
    """Qwen2_5OmniProcessor's videos: the temporal step is position_id_per_seconds x temporal patch /
    the video processor's fps setting (2 where it has none)."""

    def __init__(self, settings: VideoSettings, config: dict):
        super().__init__(settings, config)
        self.tokens_per_second = config["position_id_per_seconds"]

    def timing(self, info: VideoInfo, frames: list[int], grid: tuple[int, int, int]) -> dict:
        s = self.settings
        return {**super().timing(info, frames, grid), "seconds_per_grid": s.temporal_patch_size / (s.fps or 2.0)}


class OmniMedia(qwen_vl_media.QwenImages):
    """See the module docstring. settings: model.json's "processor"; config: its Hugging Face config."""

    media_kinds = ("image", "video", "audio")

    def __init__(self, arch: QwenVisionArch, settings: dict, config: dict):
        settings = dict(settings)
        features = settings.pop(FEATURES_KEY)
        ids = token_ids(config)
        super().__init__(arch, settings, ids, OmniVideos)
        self.extractor = _feature_extractor_class().from_dict(features)
        self.audio_tokens = ImageTokens((ids["audio_start_token_id"],), ids["audio_token_id"],
                                        (ids["audio_end_token_id"],))

    # ---- audio -------------------------------------------------------------------------------------
    def audio_items(self, info: AudioInfo) -> ImageItems:
        """An audio's item: its feature frames (as the extractor's attention mask counts them, at most
        its 30 s) as the grid (1, 1, frames), output_lengths(frames) rows."""
        frames = min(-(-info.samples // self.extractor.hop_length), self.extractor.nb_max_frames)
        rows = int(output_lengths(torch.tensor(frames)))
        t = self.audio_tokens
        return ImageItems((rows,), (frames,), ((1, 1, frames),), ((*t.prefix, *[t.placeholder] * rows, *t.suffix),))

    def audio_info(self, source) -> AudioInfo:
        return AudioInfo(len(read_audio(source, self.extractor.sampling_rate)))

    def audio_pixels(self, source, items: ImageItems) -> torch.Tensor:
        """The audio's features [frames, mel bins]; raises AudioError."""
        waveform = read_audio(source, self.extractor.sampling_rate)
        out = self.extractor(waveform, sampling_rate=self.extractor.sampling_rate, padding="max_length",
                             return_attention_mask=True, return_tensors="pt")
        frames = int(out["attention_mask"].sum())
        return out["input_features"][0, :, :frames].T.contiguous()

    def position_ids(self, seq_len: int, starts: list[int], items: list[ImageItems]) -> torch.Tensor:
        return super().position_ids(seq_len, starts, items, after_largest=True)

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
