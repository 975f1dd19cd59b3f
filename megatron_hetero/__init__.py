"""megatron-hetero: per-module parallel layouts for multimodal training on Megatron.

The repository's top-level `patches/` is the subpackage `megatron_hetero.patches`: setup.py maps it
there (`package_dir`), for the wheel and for an editable install alike.
"""

__version__ = "0.1.0"  # the one home of the version: setup.py reads it
