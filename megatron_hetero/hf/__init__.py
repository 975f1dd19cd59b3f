"""Hugging Face weights: Llama, Qwen2 (our LLM) and SigLIP, CLIP vision towers (our vision encoder)
mapped to the full (TP1/PP1) state dict of our module and back; `load_full_tensors` then puts its
part into any layout's stage.

    imported = import_hf("qwen2-dir", base=sizes)           # family, config, sizes, state
    llm = build_llm(imported.sizes, tp, pgs)                # or build_vision_encoder
    load_full_tensors(llm, imported.state, pgs.tp, allow_missing=imported.family.ours_only)
    # later, `full`: the module's full state dict (full_tensors of every stage, merged)
    export_hf("out-dir", imported.family, imported.sizes, full, imported.config)
"""

from megatron_hetero.models.accelerators import ignore_missing_warnings

# `python -m megatron_hetero.hf`, a command, imports this package, and with it megatron-core, first.
ignore_missing_warnings()

from megatron_hetero.convert.family import Family  # noqa: E402
from megatron_hetero.convert.files import Imported, export_hf, import_hf  # noqa: E402
from megatron_hetero.convert.registry import FAMILIES, family_of  # noqa: E402
from megatron_hetero.convert.rules import HFMappingError  # noqa: E402
from megatron_hetero.models.full_state import load_full_tensors  # noqa: E402

__all__ = ["FAMILIES", "Family", "HFMappingError", "Imported", "export_hf", "family_of", "import_hf",
           "load_full_tensors"]
