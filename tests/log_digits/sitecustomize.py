"""Test instrumentation for tests/test_megatron_lm.py, on the PYTHONPATH of the runs it starts:
Megatron prints `grad norm: %.3f`, too few digits for a 1e-4 relative comparison, so each logged
iteration's gradient norm is also printed as `[grad norm] iteration I: %.9e` by the last rank (the one
that prints Megatron's own line). Python imports this module at start-up; it wraps
megatron.training's `training_log` when megatron_hetero.launch runs the script (`runpy.run_path`),
so the torchrun agent and Megatron itself are untouched."""

import runpy

_run_path = runpy.run_path


def _print_grad_norm(training_log):
    def wrapper(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                skipped_iter, grad_norm, *args, **kwargs):
        from megatron.training.utils import is_last_rank

        if is_last_rank() and grad_norm is not None:
            print(f"[grad norm] iteration {iteration}: {grad_norm:.9e}", flush=True)
        return training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                            report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)
    return wrapper


def run_path(*args, **kwargs):
    from megatron.training import training

    training.training_log = _print_grad_norm(training.training_log)
    return _run_path(*args, **kwargs)


runpy.run_path = run_path
