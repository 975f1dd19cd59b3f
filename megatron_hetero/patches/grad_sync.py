"""Overlapped gradient reduction when a module's last microbatch does not reach every parameter
(megatron-core 0.19 `_ParamAndGradBucketGroup.finish_grad_sync` and `.reset`).

With `--overlap-grad-reduce`, a bucket's reduce-scatter / all-reduce is issued from the gradient
hooks of a step's last microbatch, once every parameter of the bucket has its gradient there.
megatron-hetero's encoders may get no gradient in the last microbatch (it carries no images for
them, or none of this rank's share): upstream then asserts in `finish_grad_sync` ("Communication
call has not been issued for this bucket") or, in the first step, in `reset` (the "golden" per-step
hook counts must cover every parameter). The earlier microbatches' gradients still need reducing:
- `finish_grad_sync` issues a bucket group's reduction that the hooks did not (every bucket is
  reduced once per step; it then only does not overlap);
- `reset` records the golden counts only from a step whose last microbatch reached every parameter
  of the bucket group (until then `finish_grad_sync` issues the reduction, as upstream's first step).
"""

from megatron_hetero.patches._patch import replace

OWNER = "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup"


def _finish_grad_sync(original):
    def finish_grad_sync(self, force_all_reduce=False):
        if (self.ddp_config.overlap_grad_reduce and not self.grad_reduce_finished and not self.is_first_batch
                and self.grad_reduce_handle is None):
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        return original(self, force_all_reduce)
    return finish_grad_sync


def _reset(original):
    def reset(self):
        if self.is_first_batch and len(self.per_param_grad_ready_counts) != len(self.params):
            self.per_param_grad_ready_counts = {}  # not a complete step: no golden counts from it
        return original(self)
    return reset


def apply() -> None:
    replace(f"{OWNER}.finish_grad_sync", _finish_grad_sync, params=("force_all_reduce",))
    replace(f"{OWNER}.reset", _reset, params=("self",))
