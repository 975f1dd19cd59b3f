"""Hugging Face tensors and configs to ours and back: the rules, the per-family mappings, the files."""
