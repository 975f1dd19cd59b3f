"""Llama, Qwen2 and Qwen3 causal LMs onto our LLM (megatron-core GPTModel): RMSNorm, SwiGLU, RoPE,
grouped-query attention; Qwen2 adds q/k/v biases, Qwen3 an RMSNorm over each query and key head
before RoPE (q_norm, k_norm: megatron-core's q_layernorm, k_layernorm) and a head size of its own.
All three have the same weight layout otherwise."""

from megatron_hetero.convert.family import Family, Field
from megatron_hetero.convert.rules import PaddedRows, Same, Stacked, qkv_rules
from megatron_hetero.spec.sizes import ACTIVATIONS, ModelSizes, padded_vocab_size


def llm_fields(prefix: str = "") -> tuple[Field, ...]:
    """The config fields of a Llama/Qwen2-style LLM, under `prefix` (a VLM's "text_config.")."""
    return (
        Field(f"{prefix}hidden_size", "hidden_size"),
        Field(f"{prefix}num_hidden_layers", "num_layers"),
        Field(f"{prefix}num_attention_heads", "num_attention_heads"),
        Field(f"{prefix}vocab_size", "vocab_size"),
        Field(f"{prefix}intermediate_size", "arch.ffn_hidden_size"),
        Field(f"{prefix}num_key_value_heads", "arch.num_query_groups"),
        Field(f"{prefix}head_dim", "arch.head_dim", default=None),
        Field(f"{prefix}rms_norm_eps", "arch.norm_eps"),
        Field(f"{prefix}hidden_act", "arch.activation", choices=tuple(ACTIVATIONS)),
        Field(f"{prefix}rope_parameters.rope_theta", "arch.rope_theta"),
    )


FIELDS = (*llm_fields(), Field("tie_word_embeddings", "arch.tied_embeddings"))
# Llama 3.1's "llama3" and other RoPE scalings are not mapped (GPTModel's rope_scaling would be).
ROPE = {"rope_parameters.rope_type": "default"}
ARCH = dict(normalization="RMSNorm", gated_linear_unit=True)


def llm_rules(sizes: ModelSizes, prefix: str = "model.") -> list:
    """The weight rules of a Llama/Qwen2-style LLM whose decoder's keys start with `prefix` (a VLM's
    "model.language_model."); the output layer is `lm_head.weight` either way."""
    arch = sizes.llm_arch
    heads = sizes.num_attention_heads
    groups = arch.num_query_groups or heads
    vocab = dict(vocab=sizes.vocab_size, rows=padded_vocab_size(sizes))
    rules = [PaddedRows("embedding.word_embeddings.weight", f"{prefix}embed_tokens.weight", **vocab),
             Same("decoder.final_layernorm.weight", f"{prefix}norm.weight")]
    if not arch.tied_embeddings:
        rules.append(PaddedRows("output_layer.weight", "lm_head.weight", **vocab))
    for i in range(sizes.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"{prefix}layers.{i}."
        rules += qkv_rules(f"{ours}self_attention.linear_qkv", f"{hf}self_attn", heads, groups, arch.qkv_bias)
        rules += [
            Same(f"{ours}input_layernorm.weight", f"{hf}input_layernorm.weight"),
            Same(f"{ours}self_attention.linear_proj.weight", f"{hf}self_attn.o_proj.weight"),
            Same(f"{ours}pre_mlp_layernorm.weight", f"{hf}post_attention_layernorm.weight"),
            Stacked(f"{ours}mlp.linear_fc1.weight", (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight")),
            Same(f"{ours}mlp.linear_fc2.weight", f"{hf}mlp.down_proj.weight"),
        ]
        if arch.qk_norm:
            rules += [Same(f"{ours}self_attention.{x}_layernorm.weight", f"{hf}self_attn.{x}_norm.weight")
                      for x in "qk"]
    return rules


# A tied lm_head.weight (in a model's state_dict(), not in its files) is the embedding again.
_COMMON = dict(module="llm", fields=FIELDS, rules=llm_rules, hf_tied=(("lm_head.weight", "model.embed_tokens.weight"),))
LLAMA = Family("llama", "llama", "LlamaForCausalLM", hf_fixed={"attention_bias": False, "mlp_bias": False, **ROPE},
               arch=ARCH, **_COMMON)
QWEN2 = Family("qwen2", "qwen2", "Qwen2ForCausalLM", hf_fixed={"use_sliding_window": False, **ROPE},
               arch={**ARCH, "qkv_bias": True}, **_COMMON)
QWEN3 = Family("qwen3", "qwen3", "Qwen3ForCausalLM",
               hf_fixed={"attention_bias": False, "use_sliding_window": False, **ROPE},
               arch={**ARCH, "qk_norm": True}, **_COMMON)
