"""Qwen3-Omni (transformers' qwen3_omni_moe), its thinker as three modules: Qwen3-VL's vision tower with
DeepStack (families/qwen3_vl/vision.py), an audio encoder of its own (audio.py) and a Qwen3-MoE LLM
with interleaved M-RoPE whose temporal ids count time for videos and audio (media.py); the LLM's
experts under its own ep/etp (qwen3_vl/moe.py). The talker, its code predictor and code2wav pass
through import and export unchanged; Hugging Face mapping in hf.py."""

from megatron_hetero.families.qwen2_5_omni import omni_family
from megatron_hetero.families.qwen3_omni import hf
from megatron_hetero.families.qwen3_vl import QWEN3_VL

QWEN3_OMNI = omni_family(QWEN3_VL, hf, "megatron_hetero.families.qwen3_omni",
                         "Qwen3OmniMoeThinkerForConditionalGeneration")
