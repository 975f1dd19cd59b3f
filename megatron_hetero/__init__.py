"""megatron-hetero: per-module parallel layouts for multimodal training on Megatron."""

import os as _os

# The repository's top-level patches/ is the subpackage megatron_hetero.patches: setup.py installs it
# there; a source checkout on PYTHONPATH finds it through this path entry.
__path__.append(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
