"""Reference vision-language model: a VisionEncoder and a megatron-core GPTModel, each with its own
TransformerConfig and ProcessGroupCollection. They meet only through the boundary: the LLM input
embedding at image placeholder positions is the projected encoder row delivered there."""

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models.sizes import ModelSizes
from megatron_hetero.models.specs import block_spec, llm_layer_spec
from megatron_hetero.models.vision import VisionEncoder


def _config(hidden, layers, heads, tp: int, dtype: torch.dtype, **overrides) -> TransformerConfig:
    """overrides: further TransformerConfig fields (context_parallel_size, sequence_parallel, ...)."""
    return TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=4 * hidden,
        tensor_model_parallel_size=tp,
        # Full-size master weights from the default generator, then sliced: every layout gets the
        # same model as one process does (parity), at any TP size.
        use_cpu_initialization=True,
        perform_initialization=True,
        # Loss is summed over tokens and divided by the global token count by us: DDP must sum.
        calculate_per_token_loss=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        # No linear biases (Llama-style): the key bias is in the null space of softmax attention,
        # where Adam would amplify rounding noise into layout-dependent updates.
        add_bias_linear=False,
        normalization="LayerNorm",
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        **overrides,
    )


def padded_vocab_size(sizes: ModelSizes) -> int:
    return -(-sizes.vocab_size // sizes.vocab_multiple) * sizes.vocab_multiple


def build_vision_encoder(
    sizes: ModelSizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype = torch.float32
) -> VisionEncoder:
    enc = _config(sizes.enc_hidden_size, sizes.enc_num_layers, sizes.enc_num_attention_heads, tp, dtype)
    # The projector is an MLP into the LLM's hidden size, in the encoder's TP group.
    proj = _config(sizes.hidden_size, 1, sizes.num_attention_heads, tp, dtype)
    return VisionEncoder(enc, proj, sizes.image_size, sizes.patch_size, pgs)


def build_llm(
    sizes: ModelSizes,
    tp: int,
    pgs: ProcessGroupCollection,
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> GPTModel:
    """config_overrides: further TransformerConfig fields, e.g. context_parallel_size=2,
    sequence_parallel=True (they must match pgs), num_query_groups."""
    config = _config(
        sizes.hidden_size, sizes.num_layers, sizes.num_attention_heads, tp, dtype, **config_overrides
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(llm_layer_spec(pgs), config, pgs),
        vocab_size=padded_vocab_size(sizes),
        max_sequence_length=sizes.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pg_collection=pgs,
    )


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """[1, 1, s, s], True where attention is masked (megatron-core's convention)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def llm_forward(
    llm: GPTModel,
    input_ids: torch.Tensor,
    image_slots: torch.Tensor,
    image_mask: torch.Tensor,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """input_ids [b, s]; image_slots [s, b, h] and image_mask [s, b] from the boundary.

    Returns per-token losses [b, s] with labels, else full-vocabulary logits [b, s, V]."""
    s = input_ids.shape[1]
    position_ids = torch.arange(s, device=input_ids.device)[None].expand_as(input_ids)
    text = llm.embedding(input_ids=input_ids, position_ids=position_ids)
    merged = torch.where(image_mask[..., None], image_slots.to(text.dtype), text)
    return llm(
        input_ids=None,
        position_ids=position_ids,
        attention_mask=causal_mask(s, input_ids.device),
        decoder_input=merged,
        labels=labels,
        runtime_gather_output=labels is None,
    )
