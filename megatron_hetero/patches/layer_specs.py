"""Megatron-LM's LLaVA builds its layers from megatron-core's local spec where --transformer-impl is
local (or Transformer Engine does not import); the plugin substitutes our core attention (torch SDPA)
and norms there (megatron-core 0.19 `llava_spec.decoder_model_with_local_default_spec`,
`vit_layer_specs.get_vit_layer_with_local_spec`): the same layers as the local spec's but for those
two submodules (docs/runs/benchmarks.md: 2.7x the local spec's TFLOPS on one H100). Dense layers only
(a spec with experts stays upstream's). Where Transformer Engine's layers run, scripts choose TE's
spec and nothing here applies.
"""

from megatron_hetero.patches._patch import PASS_THROUGH, replace


def _decoder_spec(original):
    def decoder_model_with_local_default_spec(num_experts=None, moe_grouped_gemm=False, **kwargs):
        from megatron_hetero.models.specs import with_our_layers

        spec = original(num_experts, moe_grouped_gemm, **kwargs)
        return spec if num_experts else with_our_layers(spec, None)
    return decoder_model_with_local_default_spec


def _vit_spec(original):
    def get_vit_layer_with_local_spec():
        from megatron_hetero.models.specs import with_our_layers

        return with_our_layers(original(), None)
    return get_vit_layer_with_local_spec


def apply() -> None:
    replace("megatron.core.models.multimodal.llava_spec.decoder_model_with_local_default_spec", _decoder_spec,
            params=("num_experts", "moe_grouped_gemm"))
    replace("megatron.core.models.vision.vit_layer_specs.get_vit_layer_with_local_spec", _vit_spec, PASS_THROUGH)
