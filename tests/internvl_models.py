"""Tiny random InternVL models (transformers' InternVLForConditionalGeneration, built offline) for the
InternVL tests: an InternViT-300M-like tower (LayerNorm, q/k/v biases) into a Qwen2 with tied
embeddings, and an InternViT-6B-like one (RMSNorm, QK-norm over all heads, no q/k/v biases) into a
Qwen3 with untied embeddings; batches of token ids and tiles, and whole model directories (weights,
tokenizer with InternVL's image tags, chat template, image processor) as the Hub's -hf repos hold them."""

from pathlib import Path

import torch

from tests.vlm_fixtures import QWEN_TEMPLATE, randomize, word_tokenizer

IMAGE, PATCH = 64, 8  # 8 x 8 patches a tile; pixel shuffle 0.5: 16 rows into the LLM
ROWS_PER_TILE = (IMAGE // PATCH) ** 2 // 4
VOCAB, IMAGE_TOKEN = 128, 120  # the model-level tests' (no tokenizer)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE,
               patch_size=PATCH, layer_norm_eps=1e-6)
_TEXT = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "internvit300m_qwen2": dict(
        vision_config=dict(**_VISION, attention_bias=True),
        text_config=dict(model_type="qwen2", **_TEXT), tie_word_embeddings=True),
    "internvit6b_qwen3": dict(
        vision_config=dict(**_VISION, attention_bias=False, use_qk_norm=True, norm_type="rms_norm"),
        text_config=dict(model_type="qwen3", **_TEXT, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        tie_word_embeddings=False, projector_hidden_act="gelu_pytorch_tanh"),
}


def hf_config(name: str, vocab: int = VOCAB, image_token: int = IMAGE_TOKEN, **fields):
    from transformers import InternVLConfig

    config = CONFIGS[name]
    text = {**config["text_config"], "vocab_size": vocab, **fields}
    return InternVLConfig(**{**config, "text_config": text}, image_token_id=image_token,
                          image_seq_length=ROWS_PER_TILE)


def hf_model(name: str, **config):
    """The model with every weight random (tests/vlm_fixtures.randomize)."""
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(0)
    return randomize(InternVLForConditionalGeneration(hf_config(name, **config)).eval())


def batch(tiles_per_sample=(3, 0), seq: int = 64, seed: int = 2):
    """input_ids [b, seq] with each sample's image tokens (ROWS_PER_TILE per tile, after a few text
    tokens) and pixel_values [tiles, 3, IMAGE, IMAGE] of every tile, sample by sample."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE_TOKEN, (len(tiles_per_sample), seq), generator=gen)
    for b, tiles in enumerate(tiles_per_sample):
        ids[b, 5:5 + tiles * ROWS_PER_TILE] = IMAGE_TOKEN
    pixels = torch.randn(sum(tiles_per_sample), 3, IMAGE, IMAGE, generator=gen)
    return ids, pixels


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
TAGS = dict(start_image_token="<img>", end_image_token="</img>", context_image_token="<IMG_CONTEXT>",
            video_token="<video>")


def internvl_dir(directory: Path, name: str = "internvit300m_qwen2", max_patches: int = 4) -> Path:
    """A tiny InternVL model directory as the Hub's -hf repos hold it: weights and config (save_pretrained:
    transformers' key names), a word-level tokenizer with InternVL's image tags and a Qwen-style chat
    template, and the image processor's preprocessor_config.json (tiles of IMAGE pixels, at most
    `max_patches` and a thumbnail)."""
    from transformers import GotOcr2ImageProcessorPil

    tok = word_tokenizer(directory, SPECIALS, QWEN_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>",
                         extra_special_tokens=TAGS)
    ids = tok.convert_tokens_to_ids
    model = hf_model(name, vocab=len(tok) + 5, image_token=ids("<IMG_CONTEXT>"), bos_token_id=ids("<|endoftext|>"),
                     eos_token_id=ids("<|im_end|>"))
    model.save_pretrained(directory)
    GotOcr2ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}, image_mean=[0.485, 0.456, 0.406],
                             image_std=[0.229, 0.224, 0.225], max_patches=max_patches).save_pretrained(directory)
    return directory
