"""Reference vision-language model: a VisionEncoder and a megatron-core GPTModel, each with its own
TransformerConfig and ProcessGroupCollection. They meet only through the boundary: the LLM input
embedding at image placeholder positions is the projected encoder row delivered there."""

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.layout import ModuleLayout
from megatron_hetero.models.sizes import ModelSizes
from megatron_hetero.models.specs import llm_layer_spec
from megatron_hetero.models.vision import VisionEncoder


def _config(hidden, layers, heads, tp: int, dtype: torch.dtype, cp: int = 1, pp: int = 1,
            sp: bool = False) -> TransformerConfig:
    return TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=4 * hidden,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sp,
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
    sizes: ModelSizes, layout: ModuleLayout, pgs: ProcessGroupCollection, pp_rank: int = 0,
    dtype: torch.dtype = torch.float32,
) -> GPTModel:
    """The LLM's pipeline stage `pp_rank` (the whole model with pp=1)."""
    config = _config(sizes.hidden_size, sizes.num_layers, sizes.num_attention_heads, layout.tp, dtype,
                     cp=layout.cp, pp=layout.pp, sp=layout.sp)
    return GPTModel(
        pre_process=pp_rank == 0,
        post_process=pp_rank == layout.pp - 1,
        config=config,
        transformer_layer_spec=llm_layer_spec(),
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
    position_ids: torch.Tensor,
    media: list[tuple[torch.Tensor, torch.Tensor]],
    labels: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pipeline stage of the LLM. input_ids [b, s] and position_ids [b, s] are this rank's
    (CP-local) sequence; on the first stage `media` holds, per encoder, the boundary's slots
    [s', b, h] and their mask [s', b] (s' the SP-local length), merged into the text embedding;
    later stages take the previous stage's `hidden` instead.

    Returns the next stage's input [s', b, h], or on the last stage per-token losses [b, s] with
    labels, else full-vocabulary logits [b, s, V]."""
    decoder_input = None
    if llm.pre_process:
        decoder_input = llm.embedding(input_ids=input_ids, position_ids=position_ids)
        for slots, mask in media:
            decoder_input = torch.where(mask[..., None], slots.to(decoder_input.dtype), decoder_input)
    else:
        llm.set_input_tensor(hidden)
    return llm(
        input_ids=None,
        position_ids=position_ids,
        attention_mask=causal_mask(input_ids.shape[1], input_ids.device),
        decoder_input=decoder_input,
        labels=labels,
        runtime_gather_output=labels is None,
    )
