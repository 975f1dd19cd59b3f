"""Tiny Qwen3-VL and Qwen3-VL-MoE model directories for the family tests, built offline with
transformers (tests/vlm_fixtures.py's tokenizer, chat template, random weights and image processor).
Two LLM layers and two DeepStack blocks (vision layers 0 and 2 into LLM layers 0 and 1): under LLM
pp=2 the second block's rows cross a pipeline stage boundary."""

from pathlib import Path

import torch

from tests.vlm_fixtures import (
    MAX_PIXELS,
    MERGE,
    MIN_PIXELS,
    PATCH,
    QWEN_SPECIALS,
    QWEN_TEMPLATE,
    randomize,
    word_tokenizer,
)

EXPERTS, TOPK, EXPERT_FFN = 4, 2, 24  # 2 * EXPERT_FFN != hidden: the two expert layouts differ in shape


def qwen3_vl_config(tok, moe: bool = False, tied: bool = False):
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    ids = tok.convert_tokens_to_ids
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=len(tok) + 5, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                 "rope_theta": 1e6},
                bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"))
    if moe:
        text.update(num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=EXPERT_FFN)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 2])
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=tied)


def model_class(moe: bool):
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    return Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration


def qwen3_vl_dir(directory: Path, moe: bool = False, tied: bool = False) -> Path:
    """A tiny Qwen3-VL(-MoE) model directory as save_pretrained writes it (the Hub's layout), with its
    tokenizer, chat template and image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = word_tokenizer(directory, QWEN_SPECIALS, QWEN_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")
    torch.manual_seed(0)
    model = randomize(model_class(moe)(qwen3_vl_config(tok, moe, tied)).eval())
    model.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                             merge_size=MERGE).save_pretrained(directory)
    return directory
