"""The input embedding's weight gradient into main_grad inside its backward (megatron-core 0.19:
`tensor_parallel.layers` imports torch.nn.functional as `F` for one call, VocabParallelEmbedding's
`F.embedding`). That module's `F` becomes torch.nn.functional with `embedding` models/embedding.py's,
which runs F.embedding itself except for a weight DDP gave a main_grad, on a GPU."""

import types

from megatron_hetero.models.embedding import embedding
from megatron_hetero.patches._patch import replace


def _functional(upstream: types.ModuleType) -> types.ModuleType:
    functional = types.ModuleType(upstream.__name__, "torch.nn.functional with models/embedding.py's embedding")
    functional.__dict__.update({k: v for k, v in vars(upstream).items() if not k.startswith("__")})
    functional.embedding = embedding
    return functional


def apply() -> None:
    replace("megatron.core.tensor_parallel.layers.F", _functional, kind=types.ModuleType)
