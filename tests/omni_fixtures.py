"""Tiny Qwen2.5-Omni and Qwen3-Omni directories for the family tests, built offline: random weights for
the whole model (the thinker; Qwen2.5-Omni's talker and token2wav, Qwen3-Omni's talker with its code
predictor and code2wav), a word-level tokenizer with the family's special tokens and a chat
template in its style, the image and video processors' and the feature extractor's settings; and
conversation data with images, videos and audio files (wav at other rates, stereo), audio without
images, and bad audio."""

import json
import wave
from pathlib import Path

import numpy as np
import torch

from tests.vlm_fixtures import (
    MAX_PIXELS,
    MERGE,
    MIN_PIXELS,
    PATCH,
    QWEN_TEMPLATE,
    VIDEO_FILES,
    conversations,
    llava,
    randomize,
    save_video_settings,
    sharegpt,
    word_tokenizer,
    write_records,
    write_video,
)

OMNI_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|IMAGE|>", "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
MEL_BINS, N_WINDOW = 16, 8


def qwen2_5_omni_config(tok, text_layers: int = 2, vision_layers: int = 2, audio_layers: int = 2):
    from transformers import Qwen2_5OmniConfig

    ids = tok.convert_tokens_to_ids
    thinker = dict(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=text_layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok) + 5, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6}),
        vision_config=dict(depth=vision_layers, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        audio_config=dict(num_mel_bins=MEL_BINS, encoder_layers=audio_layers, encoder_attention_heads=2,
                          encoder_ffn_dim=48, d_model=32, output_dim=64, n_window=N_WINDOW, max_source_positions=64),
        image_token_index=ids("<|IMAGE|>"), video_token_index=ids("<|VIDEO|>"), audio_token_index=ids("<|AUDIO|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        audio_start_token_id=ids("<|audio_bos|>"), audio_end_token_id=ids("<|audio_eos|>"))
    talker = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=40, embedding_size=64, head_dim=16,
                  rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e6})
    dit = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ff_mult=1, emb_dim=16, head_dim=16,
               repeats=1, num_embeds=30, mel_dim=16, enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 48],
               enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8,
               enc_res2net_scale=2, enc_se_channels=8, look_ahead_layers=[0], look_backward_layers=[0])
    bigvgan = dict(mel_dim=16, upsample_initial_channel=32, resblock_kernel_sizes=[3],
                   resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4])
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))


def qwen2_5_omni_dir(directory: Path, **sizes) -> Path:
    """A tiny Qwen2.5-Omni model directory as save_pretrained writes it (the Hub's key names), with
    its tokenizer, chat template, image processor and feature extractor (one preprocessor_config.json)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    tok = word_tokenizer(directory, OMNI_SPECIALS, QWEN_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")
    return save_omni(directory, lambda: Qwen2_5OmniForConditionalGeneration(qwen2_5_omni_config(tok, **sizes)))


def save_omni(directory: Path, build) -> Path:
    """The model build() makes, its weights random, saved to `directory` with the image processor's
    and the feature extractor's settings (one preprocessor_config.json) and the video processor's."""
    import transformers
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the talker's default token ids lie outside the tiny vocabularies
    randomize(build().eval()).save_pretrained(directory)
    transformers.logging.set_verbosity(verbosity)
    image = json.loads(Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                                                merge_size=MERGE).to_json_string())
    audio = json.loads(WhisperFeatureExtractor(feature_size=MEL_BINS).to_json_string())
    (directory / "preprocessor_config.json").write_text(json.dumps({**audio, **image}, indent=1))
    save_video_settings(directory, "qwen2_5_vl")
    return directory


# ---- audio data ----------------------------------------------------------------------------------
# name -> (seconds, sampling rate, channels): at the extractor's rate, resampled, stereo, one short
# enough that its last chunk is 2 frames
AUDIO_FILES = {"tone.wav": (0.5, 16000, 1), "voice.wav": (0.37, 22050, 2), "short.wav": (0.18, 8000, 1)}


def write_wav(path: Path, seconds: float, rate: int, channels: int, seed: int = 0) -> None:
    """16-bit PCM: a tone and noise."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    signal = 0.3 * np.sin(2 * np.pi * (220 + 110 * seed) * t) + 0.05 * rng.standard_normal(len(t))
    pcm = (np.clip(signal, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.repeat(pcm[:, None], channels, 1).tobytes())


def media_files(directory: Path, audios: dict) -> None:
    """conversations()'s images, `audios` (name -> (seconds, rate, channels)), VIDEO_FILES, an empty
    and a corrupt audio, under `directory`."""
    conversations(directory, bad=False)
    for seed, (name, spec) in enumerate(audios.items()):
        write_wav(directory / name, *spec, seed=seed)
    for seed, (name, (frames, fps, size)) in enumerate(VIDEO_FILES.items()):
        write_video(directory / name, frames, fps, size, seed)
    (directory / "empty.wav").write_bytes(b"")
    (directory / "corrupt.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt not audio at all")


def audio_conversations(directory: Path, bad: bool = True) -> Path:
    """audio.json under `directory` (with conversations()'s images and video_conversations()'s
    videos): audio without an image, audio and an image in one sample, two audios, an image alone,
    text alone, a video with an audio, a video longer than the frame limit (ShareGPT-style and
    LLaVA-style); with `bad`, a zero-length, a corrupt and a missing audio, and a missing video."""
    media_files(directory, AUDIO_FILES)
    records = [
        sharegpt("<audio> what is in it ?", "a red square", audios=["tone.wav"]),
        sharegpt("compare <image> and <audio>", "a blue circle on the left", images=["wide.png"],
                 audios=["voice.wav"]),
        sharegpt("<audio> and <audio> describe", "green triangle", audios=["short.wav", "tone.wav"]),
        llava("<image>\ndescribe", "shapes", image="square.png"),
        sharegpt("question text only", "answer yes"),
        sharegpt("<video> and <audio> what is in it ?", "a red circle", videos=["clip.mp4"], audios=["tone.wav"]),
        sharegpt("describe <video>", "shapes on the right", videos=["long.mp4"]),
    ]
    if bad:
        records[1:1] = [sharegpt("<audio> describe", "red", audios=["empty.wav"]),
                        sharegpt("<audio> describe", "red", audios=["corrupt.wav"]),
                        sharegpt("<audio>", "blue", audios=["gone.wav"]),
                        sharegpt("<video> what", "yes", videos=["gone.mp4"])]
    return write_records(records, directory / "audio.json", "a")


# ---- videos with their own audio -----------------------------------------------------------------
# name -> (frames, fps, (width, height), audio seconds): the audio a little longer than the frames
# (the interleave's last chunks audio only), and a longer one over several chunks
TRACK_FILES = {"talk.mp4": (8, 4, (40, 24), 2.2), "lecture.mp4": (24, 4, (24, 32), 6.1)}


def write_video_with_audio(path: Path, frames: int, fps: int, size: tuple[int, int], seconds: float,
                           seed: int = 0) -> None:
    """An MPEG-4 video of random frames with an AAC audio track (a tone and noise at 16 kHz)."""
    import av

    rng = np.random.default_rng(seed)
    rate = 16000
    t = np.arange(int(seconds * rate)) / rate
    signal = (0.3 * np.sin(2 * np.pi * 330 * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)
    with av.open(str(path), "w") as container:
        video = container.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = *size, "yuv420p"
        audio = container.add_stream("aac", rate=rate, layout="mono")
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "rgb24")
            container.mux(video.encode(frame))
        container.mux(video.encode())
        step = 1024
        for at in range(0, len(signal), step):
            frame = av.AudioFrame.from_ndarray(signal[None, at : at + step], format="flt", layout="mono")
            frame.sample_rate = rate
            container.mux(audio.encode(frame))
        container.mux(audio.encode())


def track_conversations(directory: Path, tone: tuple = AUDIO_FILES["tone.wav"]) -> Path:
    """tracks.json under `directory`: a video whose own audio the model loads, alone and with an image
    and another audio (`tone`: (seconds, rate, channels)) in one sample, and one over several chunks."""
    conversations(directory, bad=False)
    write_wav(directory / "tone.wav", *tone)
    for seed, (name, spec) in enumerate(TRACK_FILES.items()):
        write_video_with_audio(directory / name, *spec, seed=seed)

    records = [sharegpt("<video> what is in it ?", "a red square", videos=["talk.mp4"]),
               sharegpt("compare <image> and <video> then <audio>", "a blue circle", images=["wide.png"],
                        videos=["talk.mp4"], audios=["tone.wav"]),
               sharegpt("describe <video>", "shapes on the right", videos=["lecture.mp4"])]
    return write_records(records, directory / "tracks.json", "t")


# ---- Qwen3-Omni ------------------------------------------------------------------------------------
# The thinker: a 3-layer vision tower with DeepStack mergers after layers 0 and 2 (into LLM layers 0
# and 1), a 2-layer audio encoder (n_window 50 as transformers' row count assumes; attention windows
# of 2 chunks), a 2-layer LLM of 4 experts, top 2; the talker with its code predictor; code2wav.
QWEN3_OMNI_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1e6}


def qwen3_omni_config(tok):
    from transformers import Qwen3OmniMoeConfig

    ids = tok.convert_tokens_to_ids
    thinker = dict(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tok) + 5, rms_norm_eps=1e-6,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                         rope_parameters={**QWEN3_ROPE, "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 2]),
        audio_config=dict(num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=48,
                          d_model=32, output_dim=64, n_window=50, n_window_infer=200, max_source_positions=64,
                          downsample_hidden_size=8),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"), audio_token_id=ids("<|audio_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        audio_start_token_id=ids("<|audio_start|>"), audio_end_token_id=ids("<|audio_end|>"),
        position_id_per_seconds=13)
    # transformers' talker reads shared_expert_intermediate_size and spatial_merge_size, which its
    # config classes do not declare (the Hub's config.json holds them)
    talker = dict(text_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, vocab_size=40, num_experts=2,
                                   num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                   rope_parameters={**QWEN3_ROPE, "mrope_section": [2, 1, 1]}),
                  code_predictor_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=40,
                                             num_code_groups=2),
                  num_code_groups=2, thinker_hidden_size=64, spatial_merge_size=MERGE)
    code2wav = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=48, codebook_size=40, num_quantizers=2, decoder_dim=32, upsample_rates=[2, 2],
                    upsampling_ratios=[2, 2])
    return Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav)


def qwen3_omni_dir(directory: Path) -> Path:
    """The tiny Qwen3-Omni directory as save_pretrained writes it (the Hub's key names, one tensor per
    expert), with its tokenizer, chat template, image processor and feature extractor (one
    preprocessor_config.json) and video processor."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    tok = word_tokenizer(directory, QWEN3_OMNI_SPECIALS, QWEN_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")
    return save_omni(directory, lambda: Qwen3OmniMoeForConditionalGeneration(qwen3_omni_config(tok)))


# name -> (seconds, sampling rate, channels): over 3 chunks (2 attention windows) from 22.05 kHz stereo,
# over 2 at the extractor's rate, one short chunk from 8 kHz
QWEN3_AUDIO_FILES = {"speech.wav": (2.6, 22050, 2), "tone.wav": (1.3, 16000, 1), "short.wav": (0.18, 8000, 1)}


def qwen3_audio_conversations(directory: Path) -> Path:
    """audio.json under `directory` (with conversations()'s images and two videos): audio without an
    image, audio and an image in one sample, two audios, an audio shorter than one chunk, an image
    alone, text alone, a video with an audio, a video longer than the frame limit; an empty and a
    corrupt audio. No sample holds an audio shorter than one chunk beside a longer one (audio.py:
    transformers' padding)."""
    media_files(directory, QWEN3_AUDIO_FILES)
    records = [
        sharegpt("<audio> what is in it ?", "a red square", audios=["speech.wav"]),
        sharegpt("<audio> describe", "red", audios=["empty.wav"]),
        sharegpt("compare <image> and <audio>", "a blue circle on the left", images=["wide.png"], audios=["tone.wav"]),
        sharegpt("<audio> describe", "red", audios=["corrupt.wav"]),
        sharegpt("<audio> and <audio> describe", "green triangle", audios=["tone.wav", "speech.wav"]),
        sharegpt("<audio> describe", "blue", audios=["short.wav"]),
        llava("<image>\ndescribe", "shapes", image="square.png"),
        sharegpt("question text only", "answer yes"),
        sharegpt("<video> and <audio> what is in it ?", "a red circle", videos=["clip.mp4"], audios=["tone.wav"]),
        sharegpt("describe <video>", "shapes on the right", videos=["long.mp4"]),
    ]
    return write_records(records, directory / "audio.json", "a")
