"""megatron-hetero: per-module parallel layouts for multimodal training on Megatron."""

__version__ = "0.1.0"  # the one home of the version: setup.py reads it
