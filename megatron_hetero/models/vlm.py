"""Reference multimodal model: encoders (vision, audio) and a megatron-core GPTModel, each with its own
TransformerConfig and ProcessGroupCollection. They meet only through the boundary: the LLM input
embedding at placeholder positions is the projected encoder row delivered there.

Every builder builds this rank's pipeline stage of its module, read from `pgs.pp` (its layers, the
input embedding on the first stage, the projector or output layer on the last); `whole=True`
builds the pp=1 module instead, on the same TP slice: the reference init.build_stage copies from.
"""

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.activations import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.boundary.rows import write_rows
from megatron_hetero.models import specs
from megatron_hetero.models.attention import packed_seq_params
from megatron_hetero.models.audio import AudioEncoder
from megatron_hetero.models.deepstack import InterleavedMRoPE, added_after_layers, dense_additions, split_rows
from megatron_hetero.models.init import on_device
from megatron_hetero.models.specs import block_spec, llm_layer_spec
from megatron_hetero.models.vision import VisionEncoder
from megatron_hetero.models.vocab import first_rows_init, pad_vocab
from megatron_hetero.spec.sizes import ACTIVATIONS, ModelSizes, MoEArch, TransformerArch, padded_vocab_size

# TransformerArch.activation -> megatron-core's activation_func, in ACTIVATIONS' order.
ACTIVATION_FUNCS = dict(zip(ACTIVATIONS, (F.gelu, partial(F.gelu, approximate="tanh"), quick_gelu, F.silu),
                            strict=True))


def transformer_config(hidden, layers, heads, tp: int, dtype: torch.dtype, pp: int = 1, cp: int = 1,
                       sp: bool = False, arch: TransformerArch = TransformerArch(), **overrides) -> TransformerConfig:
    """overrides: further TransformerConfig fields (e.g. num_query_groups), or replacements of these."""
    if layers % pp:
        raise ValueError(f"{layers} layers do not split into pp={pp} equal stages; use a multiple of {pp}")
    if arch.activation not in ACTIVATION_FUNCS:
        raise ValueError(f"activation {arch.activation!r} is not one of {', '.join(ACTIVATIONS)}")
    fields = dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=arch.ffn_hidden_size or 4 * hidden,
        activation_func=ACTIVATION_FUNCS[arch.activation],
        normalization=arch.normalization,
        layernorm_epsilon=arch.norm_eps,
        tensor_model_parallel_size=tp,
        # megatron-core sizes a stage's TransformerBlock from this and pg_collection.pp's rank.
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
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
        # By default no linear biases (Llama-style): the key bias is in the null space of softmax
        # attention, where Adam would amplify rounding noise into layout-dependent updates.
        add_bias_linear=arch.linear_bias,
        gated_linear_unit=arch.gated_linear_unit,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
    )
    config = TransformerConfig(**{**fields, **overrides})
    for field in ("init_method", "output_layer_init_method", "embedding_init_method"):
        setattr(config, field, on_device(getattr(config, field)))
    return config


def _stage(pgs: ProcessGroupCollection, whole: bool) -> tuple[int, bool, bool]:
    """(pp size, pre_process, post_process) of the module this rank builds."""
    if whole:
        return 1, True, True
    pp, rank = pgs.pp.size(), pgs.pp.rank()
    return pp, rank == 0, rank == pp - 1


def build_encoder(cls, dims, inputs, sizes, tp, pgs, dtype, whole, config_arch=TransformerArch(),
                  config_overrides=None, projector_arch=TransformerArch(), **kwargs):
    """cls(encoder config, projector config, *inputs, pgs, **kwargs) as this rank's stage (the whole
    module with `whole`); dims: the encoder's (hidden size, layers, attention heads); config_arch:
    the encoder config's architecture choices, projector_arch the projector's; config_overrides:
    further fields of both configs."""
    pp, first, last = _stage(pgs, whole)
    overrides = config_overrides or {}
    # Its CP size, `pgs.cp`'s (1 for an encoder replicated over cp), as the LLM's config has its own.
    enc = transformer_config(*dims, tp, dtype, pp, cp=pgs.cp.size(), arch=config_arch, **overrides)
    # The projector is an MLP into the LLM's hidden size, in the encoder's TP group.
    proj = transformer_config(sizes.hidden_size, 1, sizes.num_attention_heads, tp, dtype, arch=projector_arch,
                              **overrides)
    return cls(enc, proj, *inputs, pgs, pre_process=first, post_process=last, **kwargs)


def build_vision_encoder(
    sizes: ModelSizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype = torch.float32,
    whole: bool = False, **config_overrides,
) -> VisionEncoder:
    dims = (sizes.enc_hidden_size, sizes.enc_num_layers, sizes.enc_num_attention_heads)
    return build_encoder(VisionEncoder, dims, (sizes.image_size, sizes.patch_size), sizes, tp, pgs, dtype, whole,
                         sizes.vision_arch, config_overrides=config_overrides, arch=sizes.vision_arch)


def build_audio_encoder(
    sizes: ModelSizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype = torch.float32,
    whole: bool = False, **config_overrides,
) -> AudioEncoder:
    dims = (sizes.audio_hidden_size, sizes.audio_num_layers, sizes.audio_num_attention_heads)
    return build_encoder(AudioEncoder, dims, (sizes.audio_mel_bins, sizes.audio_frames), sizes, tp, pgs, dtype,
                         whole, config_overrides=config_overrides)


def build_llm(
    sizes: ModelSizes, tp: int, pgs: ProcessGroupCollection, dtype: torch.dtype = torch.float32,
    whole: bool = False, sp: bool = False, transformer_layer_spec=None, packed: bool = False, **config_overrides,
) -> GPTModel:
    """This rank's LLM stage; its CP size is `pgs.cp`'s (the sequence layout does not change the
    weights), its vocabulary padded for `tp` (models/vocab.py: the padding is not the model's), `sp`
    turns on sequence parallelism; transformer_layer_spec replaces our layers (e.g.
    megatron-core's local spec, to compare); `packed`: it will see packed sequences (our attention
    even where Transformer Engine imports: specs.llm_uses_te); config_overrides: further
    TransformerConfig fields (e.g. num_query_groups)."""
    pp, first, last = _stage(pgs, whole)
    arch = sizes.llm_arch
    fields = dict(num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim, add_qkv_bias=arch.qkv_bias,
                  mrope_section=None if arch.mrope_section is None else list(arch.mrope_section),
                  qk_layernorm=arch.qk_norm, **_moe_fields(arch.moe, pgs))
    config = transformer_config(sizes.hidden_size, sizes.num_layers, sizes.num_attention_heads, tp, dtype, pp,
                                cp=pgs.cp.size(), sp=sp, arch=arch, **{**fields, **config_overrides})
    num_experts = arch.moe.num_experts if arch.moe else None
    te = specs.llm_uses_te(config, packed)
    whole_rows = padded_vocab_size(sizes)  # the padding's own initial weights do not depend on tp
    config.embedding_init_method = on_device(first_rows_init(config.embedding_init_method, whole_rows))
    spec = transformer_layer_spec or block_spec(llm_layer_spec(pgs, num_experts, te, arch.qk_norm), config, pgs, te)
    llm = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(sizes, tp),
        max_sequence_length=sizes.seq_length,
        pre_process=first,
        post_process=last,
        position_embedding_type="rope" if arch.mrope_section is None else "mrope",
        rotary_base=arch.rope_theta,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        pg_collection=pgs,
    )
    pad_vocab(llm, sizes.vocab_size, whole_rows, pgs.tp)
    if arch.mrope_interleaved:  # Qwen3-VL's frequency sections (models/deepstack.py)
        llm.rotary_pos_emb = InterleavedMRoPE(config.kv_channels, 1.0, arch.mrope_section, rotary_base=arch.rope_theta)
    if arch.mrope_section is not None:
        # M-RoPE takes the whole sequence's position ids [3, b, S] and keeps this rank's
        # load-balanced CP chunks: of the LLM's own cp group, not parallel_state's.
        llm.rotary_pos_emb.cp_group = pgs.cp
    return llm


def _moe_fields(moe: MoEArch | None, pgs: ProcessGroupCollection) -> dict:
    """TransformerConfig fields of megatron-core's MoE layers; expert parallel sizes from the
    module's expert groups (megatron's grouped GEMM off: it needs Transformer Engine; the experts run
    grouped GEMMs as models/experts.py's GroupedExperts)."""
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff,
        moe_token_dispatcher_type=moe.dispatcher,
        moe_grouped_gemm=False,
        expert_model_parallel_size=pgs.ep.size(),
        expert_tensor_parallel_size=pgs.expt_tp.size(),
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
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pipeline stage of the LLM. input_ids [b, s] and position_ids [b, s] are this rank's
    (CP-local) sequence; on the first stage `media` holds, per encoder, the boundary's rows [n, h]
    and where they go in the text embedding [s', b, h] (s' the SP-local length; rows [n] of its
    [s' * b, h] view: boundary.input_rows), written there in place of the text (rows [n, h * (1 + k)]
    carry k DeepStack blocks, added after LLM layers 0..k-1: models/deepstack.py);
    later stages take the previous stage's `hidden` instead ([s', b, h * (1 + blocks still to add)]).
    `documents` [b, S]: a packed batch's sample of every position of the whole sequence (attention
    stays within one; on the host, so that its document boundaries cost no device synchronization).

    Returns the next stage's input [s', b, h * (1 + blocks for later stages)], or on the last stage
    per-token losses [b, s] with labels, else full-vocabulary logits [b, s, V]."""
    decoder_input, additions, width = None, [], llm.config.hidden_size
    if llm.pre_process:
        decoder_input = llm.embedding(input_ids=input_ids, position_ids=position_ids)
        for rows, at in media:
            rows, blocks = split_rows(rows, width)
            # In place (the embedding's backward does not read its output; autograd's version
            # check guards that): one pass over the image rows, none over the text; into a copy where
            # the embedding is a view (WriteRows).
            decoder_input = write_rows(decoder_input, rows, at)
            # several encoders' blocks (their rows at disjoint positions) into one addition per layer
            if blocks:
                additions = ([write_rows(a, block, at) for a, block in zip(additions, blocks)] if additions
                             else dense_additions(blocks, at, decoder_input))
    else:
        hidden, *additions = hidden.split(width, dim=-1)
        llm.set_input_tensor(hidden.contiguous() if additions else hidden)
    packed = None if documents is None else packed_seq_params(documents, input_ids.device)
    with added_after_layers(llm, additions) as carried:
        out = llm(input_ids=None, position_ids=position_ids, attention_mask=causal_mask(input_ids.shape[1],
                  input_ids.device), decoder_input=decoder_input, labels=labels,
                  runtime_gather_output=labels is None, packed_seq_params=packed)
    assert not (carried and llm.post_process), "every DeepStack block has its layer"
    return torch.cat([out, *carried], dim=-1) if carried else out
