"""Layer specs: Transformer Engine's when it is importable, megatron-core's local layers otherwise."""

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.vision.vit_layer_specs import (
    get_vit_layer_with_local_spec,
    get_vit_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec

try:
    import transformer_engine  # noqa: F401  (only whether it imports matters)

    HAVE_TE = True
except ImportError:
    HAVE_TE = False


def llm_layer_spec() -> ModuleSpec:
    """Causal decoder layer for the LLM."""
    return get_gpt_layer_with_transformer_engine_spec() if HAVE_TE else get_gpt_layer_local_spec()


def encoder_layer_spec() -> ModuleSpec:
    """Bidirectional (no mask) layer for encoders."""
    return get_vit_layer_with_transformer_engine_spec() if HAVE_TE else get_vit_layer_with_local_spec()
