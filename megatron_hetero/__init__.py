"""megatron-hetero: per-module parallel layouts for multimodal training on Megatron."""
