"""Qwen3-VL-MoE's LLM: Qwen3-VL's (hf.py) with a Qwen3-MoE block in every layer: a router (softmax
over the experts, the top k renormalized: megatron-core's router with its top-k softmax) and SwiGLU
experts (megatron-core's MoE layer under the LLM's ep/etp, as the reference model's MoE).

transformers 5 keeps each layer's experts as two fused tensors, `experts.gate_up_proj` [experts,
2 * ffn, hidden] ([gate; up] rows, as our fc1) and `experts.down_proj` [experts, hidden, ffn], and
save_pretrained writes them so; the checkpoints published on the Hub hold them transposed per expert
([experts, hidden, 2 * ffn], [experts, ffn, hidden]) under the same names (transformers transposes on
load). Both are schemes of the family (SCHEMES): the files' shapes say which (KeyScheme.shapes;
where 2 * ffn = hidden they cannot, and transformers' layout is taken)."""

from dataclasses import replace

from megatron_hetero.convert.family import Family
from megatron_hetero.convert.rules import Same, SplitExperts
from megatron_hetero.families.base import KeyScheme
from megatron_hetero.families.qwen3_vl.hf import (
    TEXT,
    TEXT_ARCH,
    TEXT_FIELDS,
    TEXT_FIXED,
    text_rules,
    vision_part,
    vision_rules,
)
from megatron_hetero.families.qwen3_vl.hf import finish as qwen3_vl_finish
from megatron_hetero.spec.sizes import ModelSizes, MoEArch

MOE_FIXED = {**TEXT_FIXED, "text_config.decoder_sparse_step": 1, "text_config.mlp_only_layers": []}


def moe_rules(sizes: ModelSizes, transposed: bool = False) -> list:
    """The LLM's rules: Qwen3-VL's without the dense MLP, and per layer the router and the experts
    (`transposed`: the Hub's per-expert layout)."""
    rules = [rule for rule in text_rules(sizes) if ".mlp." not in rule.ours]  # the dense MLP's
    return rules + fused_expert_rules(sizes, TEXT, transposed)


def fused_expert_rules(sizes: ModelSizes, prefix: str, transposed: bool = False) -> list:
    """Per layer of the LLM whose keys start with `prefix`, the router and the fused experts."""
    experts = range(sizes.llm_arch.moe.num_experts)
    rules = []
    for i in range(sizes.num_layers):
        ours, hf = f"decoder.layers.{i}.mlp.", f"{prefix}layers.{i}.mlp."
        local = f"{ours}experts.local_experts."
        rules += [Same(f"{ours}router.weight", f"{hf}gate.weight"),
                  SplitExperts(tuple(f"{local}{e}.linear_fc1.weight" for e in experts), f"{hf}experts.gate_up_proj",
                               transposed),
                  SplitExperts(tuple(f"{local}{e}.linear_fc2.weight" for e in experts), f"{hf}experts.down_proj",
                               transposed)]
    return rules


def expert_shapes(sizes: ModelSizes, transposed: bool) -> dict[str, tuple[int, ...]]:
    """The fused expert tensors' shapes in a scheme's files (the schemes share their names)."""
    moe, hidden = sizes.llm_arch.moe, sizes.hidden_size
    gate_up, down = (moe.num_experts, 2 * moe.ffn_hidden_size, hidden), (moe.num_experts, hidden, moe.ffn_hidden_size)
    if transposed:
        gate_up, down = (gate_up[0], gate_up[2], gate_up[1]), (down[0], down[2], down[1])
    return {f"{TEXT}layers.{i}.mlp.experts.{name}": shape for i in range(sizes.num_layers)
            for name, shape in (("gate_up_proj", gate_up), ("down_proj", down))}


def with_moe(sizes: ModelSizes, config) -> ModelSizes:
    """The LLM's MoE sizes from text_config (its load-balancing loss only where transformers' own
    training computes it: output_router_logits, a field some transformers 5 releases lack)."""
    text = config.text_config
    aux = text.router_aux_loss_coef if getattr(text, "output_router_logits", False) else 0.0
    moe = MoEArch(num_experts=text.num_experts, topk=text.num_experts_per_tok,
                  ffn_hidden_size=text.moe_intermediate_size, aux_loss_coeff=aux)
    return replace(sizes, llm_arch=replace(sizes.llm_arch, moe=moe))


VISION_PART = vision_part("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration")
TEXT_PART = Family("qwen3_vl_moe.text", "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "llm", TEXT_FIELDS,
                   hf_fixed=MOE_FIXED, arch=TEXT_ARCH, rules=moe_rules)


def finish(sizes: ModelSizes, config) -> ModelSizes:
    return with_moe(qwen3_vl_finish(sizes, config), config)


def _hub_rules(sizes: ModelSizes) -> dict[str, list]:
    return {"vision": vision_rules(sizes), "llm": moe_rules(sizes, transposed=True)}


SCHEMES = (KeyScheme("transformers", shapes=lambda sizes: expert_shapes(sizes, False)),
           KeyScheme("hub", rules=_hub_rules, shapes=lambda sizes: expert_shapes(sizes, True)))
