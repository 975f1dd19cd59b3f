"""A tiny Qwen3-Omni directory for the family tests, built offline: random weights for the whole model
(the thinker, the talker with its code predictor, code2wav), a word-level tokenizer with the family's
special tokens and a chat template in its style, the image and video processors' and the feature
extractor's settings; and conversation data with images, videos and audio files. The thinker: a
3-layer vision tower with DeepStack mergers after layers 0 and 2 (into LLM layers 0 and 1), a 2-layer
audio encoder (n_window 50 as transformers' row count assumes; attention windows of 2 chunks), a
2-layer LLM of 4 experts, top 2."""

import json
from pathlib import Path

import torch

from tests.omni_fixtures import write_wav
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

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
MEL_BINS = 16
ROPE = {"rope_type": "default", "rope_theta": 1e6}


def qwen3_omni_config(tok):
    from transformers import Qwen3OmniMoeConfig

    ids = tok.convert_tokens_to_ids
    thinker = dict(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tok) + 5, rms_norm_eps=1e-6,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                         rope_parameters={**ROPE, "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
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
                                   rope_parameters={**ROPE, "mrope_section": [2, 1, 1]}),
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
    import transformers
    from transformers import Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = word_tokenizer(directory, SPECIALS, QWEN_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")
    torch.manual_seed(0)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the talker's default token ids lie outside the tiny vocabularies
    model = randomize(Qwen3OmniMoeForConditionalGeneration(qwen3_omni_config(tok)).eval())
    model.save_pretrained(directory)
    transformers.logging.set_verbosity(verbosity)
    image = json.loads(Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                                                merge_size=MERGE).to_json_string())
    audio = json.loads(WhisperFeatureExtractor(feature_size=MEL_BINS).to_json_string())
    (directory / "preprocessor_config.json").write_text(json.dumps({**audio, **image}, indent=1))
    save_video_settings(directory, "qwen2_5_vl")
    return directory


# name -> (seconds, sampling rate, channels): over 3 chunks (2 attention windows) from 22.05 kHz stereo,
# over 2 at the extractor's rate, one short chunk from 8 kHz
AUDIO_FILES = {"speech.wav": (2.6, 22050, 2), "tone.wav": (1.3, 16000, 1), "short.wav": (0.18, 8000, 1)}


def audio_conversations(directory: Path) -> Path:
    """audio.json under `directory` (with conversations()'s images and two videos): audio without an
    image, audio and an image in one sample, two audios, an audio shorter than one chunk, an image
    alone, text alone, a video with an audio, a video longer than the frame limit; an empty and a
    corrupt audio. No sample holds an audio shorter than one chunk beside a longer one (audio.py:
    transformers' padding)."""
    conversations(directory, bad=False)
    for seed, (name, spec) in enumerate(AUDIO_FILES.items()):
        write_wav(directory / name, *spec, seed=seed)
    for seed, (name, (frames, fps, size)) in enumerate(VIDEO_FILES.items()):
        write_video(directory / name, frames, fps, size, seed)
    (directory / "empty.wav").write_bytes(b"")
    (directory / "corrupt.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt not audio at all")
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
