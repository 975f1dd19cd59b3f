"""A reproducible non-finite result without `--save` (megatron.training 0.19 `train`).

Megatron's rerun state machine (`--rerun-mode validate_results`, the default) reruns a step whose loss
or gradients are NaN/Inf, and when the rerun reproduces it asks `train()` for a checkpoint before
exiting (exit code 16, "resume to disambiguate"). Without `--save`, save_checkpoint_and_time fails
with a TypeError traceback on every rank; under --hetero-layout it says in one line that no
checkpoint is written, and the run exits with the state machine's code.
"""

from megatron.training import get_args, print_rank_0

from megatron_hetero.patches._patch import PASS_THROUGH, replace


def _save_checkpoint_and_time(original):
    def save_checkpoint_and_time(*args, **kwargs):
        run_args = get_args()
        if run_args.hetero_run is not None and not run_args.save:
            print_rank_0("megatron-hetero: no --save given: no checkpoint is written before exiting")
            return None
        return original(*args, **kwargs)
    return save_checkpoint_and_time


def apply() -> None:
    replace("megatron.training.training.save_checkpoint_and_time", _save_checkpoint_and_time, PASS_THROUGH)
