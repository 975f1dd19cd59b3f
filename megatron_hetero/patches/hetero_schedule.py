"""megatron-hetero's schedules as the forward-backward function of `train()` and `evaluate()`
(megatron.training 0.19 imports `get_forward_backward_func` into training.py)."""

from megatron.training import get_args

from megatron_hetero.patches._patch import PASS_THROUGH, replace
from megatron_hetero.schedules.forward_backward import forward_backward


def _get_forward_backward_func(original):
    def get_forward_backward_func(*args, **kwargs):
        if get_args().hetero_run is None:
            return original(*args, **kwargs)
        return forward_backward
    return get_forward_backward_func


def apply() -> None:
    replace("megatron.training.training.get_forward_backward_func", _get_forward_backward_func, PASS_THROUGH)
