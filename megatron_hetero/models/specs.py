"""Layer specs: Transformer Engine's where the config's kernel policy runs them (TE imports,
transformer_impl not local); otherwise megatron-core's local layers with our core attention (SDPA,
context parallelism), norm (sequence parallelism), dense MLP (the activation in quack's GEMMs where
they run), MoE experts (grouped GEMMs where they run) and residual adds (models/residual_add.py)
substituted."""

import functools
from dataclasses import replace

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.vision.vit_layer_specs import (
    get_vit_layer_with_local_spec,
    get_vit_layer_with_transformer_engine_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank

from megatron_hetero.models import kernel_policy
from megatron_hetero.models.attention import SDPAttention, attention_summary
from megatron_hetero.models.experts import GroupedExperts, experts_summary
from megatron_hetero.models.loss_kernels import loss_summary
from megatron_hetero.models.mlp import EpilogueMLP, mlp_summary
from megatron_hetero.models.norm import SequenceParallelNorm, norm_summary
from megatron_hetero.models.residual_add import bias_dropout_add


def uses_te(config: TransformerConfig) -> bool:
    """Transformer Engine's layers: where TE imports and the config's kernel policy (transformer_impl,
    Megatron's --transformer-impl) asks."""
    return kernel_policy.of(config).te


def with_our_layers(layer: ModuleSpec, pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
    """megatron's local layer spec with our attention, norms (query/key norms included, where the spec
    has them), dense MLP, an MoE layer's experts and residual adds; its other submodules (the router)
    kept."""
    norm = _norm_spec(pg_collection, has_residual=True)
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    mlp = layer.submodules.mlp
    if isinstance(mlp, functools.partial) and mlp.func == MLP.as_mlp_submodule:
        layer.submodules.mlp = functools.partial(EpilogueMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    moe = getattr(mlp, "keywords", {}).get("submodules")
    experts = getattr(moe, "experts", None)
    if isinstance(experts, functools.partial) and experts.func is SequentialMLP:
        grouped = functools.partial(GroupedExperts, *experts.args, **experts.keywords)
        layer.submodules.mlp = functools.partial(mlp.func, *mlp.args,
                                                 **{**mlp.keywords, "submodules": replace(moe, experts=grouped)})
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = SDPAttention
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) not in (None, IdentityOp):
            # Over each head of whole sequences: finalize_model_grads sums their gradients over TP.
            setattr(attention, name, ModuleSpec(module=SequenceParallelNorm, params={"over_sequence": False}))
    for name in ("self_attn_bda", "mlp_bda"):
        if getattr(layer.submodules, name) is get_bias_dropout_add:
            setattr(layer.submodules, name, bias_dropout_add)
    return layer


def _norm_spec(pg_collection: ProcessGroupCollection | None, has_residual: bool = False) -> ModuleSpec:
    # megatron builds norms from (config, hidden_size, eps): the TP group comes bound; a layer's norms
    # hand back the residual (norm.py: why), the block's final one has none.
    tp_group = None if pg_collection is None else pg_collection.tp
    return ModuleSpec(module=SequenceParallelNorm, params={"tp_group": tp_group, "has_residual": has_residual})


def llm_uses_te(config: TransformerConfig, packed: bool) -> bool:
    """Transformer Engine's layers for the LLM where its config asks (uses_te), but not for packed
    sequences: our attention keeps each packed sample's tokens to themselves (PackedSeqParams.seq_idx); TE's would
    need the thd layout and cu_seqlens, which this runtime does not build, and would otherwise
    attend across samples."""
    return uses_te(config) and not packed


def llm_layer_spec(pg_collection: ProcessGroupCollection | None = None, num_experts: int | None = None,
                   te: bool = False, qk_norm: bool = False) -> ModuleSpec:
    """Causal decoder layer for the LLM. pg_collection: the LLM's groups, needed (for the norms'
    TP group) with sequence parallelism and without Transformer Engine; num_experts: megatron-core's
    MoE layer for the MLP (its experts GroupedExperts without Transformer Engine); te: Transformer
    Engine's layers (llm_uses_te); qk_norm: a norm over each query and key head before RoPE (Qwen3;
    config.qk_layernorm)."""
    if te:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_norm)
    return with_our_layers(get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_norm), pg_collection)


def encoder_uses_te(config: TransformerConfig, pg_collection: ProcessGroupCollection | None) -> bool:
    """Transformer Engine's layers for an encoder where its config asks (uses_te), but not under CP: an
    encoder's CP parts are contiguous, attended to in full through our attention's gather (models/encoder.py),
    the path its tests check against one process."""
    cp = pg_collection.cp if pg_collection is not None else None
    return uses_te(config) and (cp is None or cp.size() == 1)


def encoder_layer_spec(pg_collection: ProcessGroupCollection | None = None, te: bool = False) -> ModuleSpec:
    """Bidirectional (no mask) layer for encoders; te: Transformer Engine's layers (encoder_uses_te)."""
    if te:
        return get_vit_layer_with_transformer_engine_spec()
    return with_our_layers(get_vit_layer_with_local_spec(), pg_collection)


def block_spec(
    layer: ModuleSpec, config: TransformerConfig, pg_collection: ProcessGroupCollection, te: bool = False
) -> ModuleSpec | TransformerBlockSubmodules:
    """The `spec` for TransformerBlock (GPTModel's `transformer_layer_spec`) from a layer spec.

    With Transformer Engine's layers (`te`: llm_uses_te, encoder_uses_te) the layer spec itself (the
    block's final norm is TE's). With ours, the block's final norm would be megatron's torch norm,
    which refuses sequence parallelism: the layers of this pipeline stage are listed with our norm as the final one."""
    if te:
        return layer
    num_layers = get_num_layers_to_build(config, pp_rank=get_pg_rank(pg_collection.pp))
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=_norm_spec(pg_collection))


KERNEL_KINDS = ("attention", "norms", "mlp", "experts", "loss")  # the start-up lines' and benchmark records' keys


def kernel_summaries(part) -> dict[str, str]:
    """What our layers of a model part run, by KERNEL_KINDS (e.g. {"attention": "fa4 (head dim 128)",
    "norms": "quack", "mlp": "quack (gelu_erf)"}); the loss: the LLM's last stage's."""
    return dict(zip(KERNEL_KINDS, (attention_summary(part), norm_summary(part), mlp_summary(part),
                                   experts_summary(part), loss_summary(part))))
