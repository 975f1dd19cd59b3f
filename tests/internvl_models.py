"""Tiny random InternVL models (transformers' InternVLForConditionalGeneration, built offline) and
batches for the InternVL tests: an InternViT-300M-like tower (LayerNorm, q/k/v biases) into a Qwen2
with tied embeddings, and an InternViT-6B-like one (RMSNorm, QK-norm over all heads, no q/k/v biases)
into a Qwen3 with untied embeddings."""

import torch

IMAGE, PATCH = 64, 8  # 8 x 8 patches a tile; pixel shuffle 0.5: 16 rows into the LLM
ROWS_PER_TILE = (IMAGE // PATCH) ** 2 // 4
VOCAB, IMAGE_TOKEN = 128, 120
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE,
               patch_size=PATCH, layer_norm_eps=1e-6)
_TEXT = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB)
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


def hf_config(name: str):
    from transformers import InternVLConfig

    return InternVLConfig(**CONFIGS[name], image_token_id=IMAGE_TOKEN, image_seq_length=ROWS_PER_TILE)


@torch.no_grad()
def hf_model(name: str):
    """The model with every weight random (transformers initializes norms and layer scales to
    constants and biases to 0, which would hide a misplaced one): matrices ~ N(0, 1/fan_in), norm
    weights and layer scales 1 + N(0, 0.1^2), other vectors N(0, 0.1^2)."""
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(hf_config(name)).eval()
    gen = torch.Generator().manual_seed(1)
    for pname, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() > 1:
            p.copy_(noise * p[0].numel() ** -0.5)
        else:
            unit = ("norm" in pname and pname.endswith("weight")) or "lambda" in pname
            p.copy_(unit + 0.1 * noise)
    return model


def batch(tiles_per_sample=(3, 0), seq: int = 64, seed: int = 2):
    """input_ids [b, seq] with each sample's image tokens (ROWS_PER_TILE per tile, after a few text
    tokens) and pixel_values [tiles, 3, IMAGE, IMAGE] of every tile, sample by sample."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE_TOKEN, (len(tiles_per_sample), seq), generator=gen)
    for b, tiles in enumerate(tiles_per_sample):
        ids[b, 5:5 + tiles * ROWS_PER_TILE] = IMAGE_TOKEN
    pixels = torch.randn(sum(tiles_per_sample), 3, IMAGE, IMAGE, generator=gen)
    return ids, pixels


# InternVL's chat template (transformers' conversion script's): an image content is "<image>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = {"<IMG_CONTEXT>": IMAGE_TOKEN, "<img>": IMAGE_TOKEN + 1, "</img>": IMAGE_TOKEN + 2,
            "<|im_start|>": IMAGE_TOKEN + 3, "<|im_end|>": IMAGE_TOKEN + 4, "<unk>": IMAGE_TOKEN + 5,
            "<video>": IMAGE_TOKEN + 6, "<image>": IMAGE_TOKEN + 7}
WORDS = [f"w{i}" for i in range(IMAGE_TOKEN - 3)] + ["user", "assistant", "system"]


def write_model_dir(directory, name: str, max_patches: int = 6):
    """A model directory as the Hub's InternVL-hf repos hold it: the tiny model's weights and config,
    a word-level tokenizer (InternVL's image tokens at the ids the config names, its chat template),
    the image processor's preprocessor_config.json (tiles of IMAGE pixels). Returns the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GotOcr2ImageProcessorPil, PreTrainedTokenizerFast

    model = hf_model(name)
    model.save_pretrained(directory)
    vocab = {**{w: i for i, w in enumerate(WORDS)}, **SPECIALS}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|im_end|>",
        additional_special_tokens=[t for t in SPECIALS if t != "<unk>"],
        extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                              "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    GotOcr2ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}, image_mean=[0.485, 0.456, 0.406],
                             image_std=[0.229, 0.224, 0.225], max_patches=max_patches).save_pretrained(directory)
    return model
