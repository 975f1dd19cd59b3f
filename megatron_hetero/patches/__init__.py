"""megatron-hetero's changes to megatron-core, megatron.training and torch, one module per concern,
each through _patch.py (checked against the upstream signature, recorded, undoable).

Installed as `megatron_hetero.patches`. `apply()` installs every patch (idempotent); the launcher
(`python -m megatron_hetero.launch SCRIPT.py ...`) calls it before running the script, and scripts
that import megatron_hetero themselves call it first:

    import megatron_hetero.patches
    megatron_hetero.patches.apply()

Without `--hetero-layout` these act as upstream does: hetero_init, hetero_model, hetero_optimizer,
hetero_data, hetero_schedule, faults, rerun, checkpointing's save and load (each checks for the run
a layout builds), metrics (only with --metrics-file), arguments' layout handling. These act
without a layout too, as defaults, each for its reason:
- startup: Megatron-LM's scripts start with only the wheel (the compiled dataset helpers, CPU
  allowed, CLIP's ln_pre without TE) and CUDA_DEVICE_MAX_CONNECTIONS=1 where unset (Megatron's
  check asks for it with TP or CP); without them those scripts stop before training;
- arguments: fused kernels that need apex or TE default off without them (else the first forward
  fails), gloo on CPUs; our flags are accepted (inert unless given);
- cpu: only where no GPU is present (CUDA-only calls on the host; nothing changes on GPUs);
- quiet: one line instead of ~40 "TE/apex not installed" warnings per process;
- layer_specs: without TE, Megatron-LM's local spec gets our core attention (torch SDPA) and norms,
  2.27x the local spec's TFLOPS (LLM layers, TP2 on 2 H200s: 468 vs 207; docs/runs/benchmarks.md);
- rope: on GPUs, RoPE's rotation as one compiled kernel each way, +1.5% TFLOPS on W1 (one H200;
  the same numbers up to bf16 rounding; MEGATRON_HETERO_EAGER_ROPE=1 for upstream's);
- grad_accum_fusion: without apex, --gradient-accumulation-fusion (Megatron's default) on torch's
  GEMM instead of off, +1.5-2.0% TFLOPS on W1/W3 together with fused_adam (docs/runs/benchmarks.md);
- fa4_backward: where flash-attn-4 is installed, its Hopper backward's dQ at head dims that are not
  multiples of 32 (72, 80) as its upstream fix computes it; the layers still run flash-attn-4 at a
  head dim only once `kernels check attention` passed it on that GPU model;
- embedding_grad: on GPUs, the input embedding's weight gradient added into its main_grad by the
  lookup's backward, not written as a dense [vocabulary, hidden] table and added by DDP's hook;
- loss: on GPUs where its check passed, the LLM's fused loss (--cross-entropy-loss-fusion, whole
  vocabulary on one rank) on quack's one-pass cross entropy instead of megatron-core's five compiled
  kernels over fp32 copies of the logits (models/loss_kernels.py);
- moe_dispatch: megatron-core's all-to-all MoE dispatcher keeps its token counts on the GPU where
  one rank holds every expert (dropless): no host sync per MoE layer, no identity sort of the tokens;
- device_init: on GPUs, our models' full-size initial weights drawn on the device, not the host
  (11 -> 2.3 ns per weight: a 7B model's start-up over a minute shorter per rank; Megatron-LM's
  models keep upstream's);
- fused_adam: on GPUs, torch's fused Adam kernel instead of foreach: one step over 2.1B parameters
  62 -> 22 ms on an H100;
- multi_tensor: megatron-core's optimizer step without a Python loop over the parameters (the gradient
  norm and the clip without apex or TE, the main params' copy into the weights): torch's multi-tensor
  kernels, and no host wait per parameter;
- torch_adam: the distributed optimizer's checkpoints with torch's Adam load at all, and resume
  with the right bias correction (three upstream faults without TE/apex);
- grad_sync: --overlap-grad-reduce where a bucket's last-microbatch gradients never all arrived
  (only then: upstream asserts);
- checkpointing's results queue: a synchronous save's results travel in a thread queue, not a new
  Manager process per rank (tens of CPU seconds per save on a small machine).
"""

from megatron_hetero.patches import quiet

quiet.install()  # before megatron-core is imported

from megatron_hetero.patches import (  # noqa: E402
    arguments,
    checkpointing,
    cpu,
    device_init,
    embedding_grad,
    fa4_backward,
    faults,
    fused_adam,
    grad_accum_fusion,
    grad_sync,
    hetero_data,
    hetero_init,
    hetero_model,
    hetero_optimizer,
    hetero_schedule,
    layer_specs,
    loss,
    metrics,
    moe_dispatch,
    multi_tensor,
    rerun,
    rope,
    startup,
    torch_adam,
)
from megatron_hetero.patches._patch import PatchError, check_version  # noqa: E402


def apply() -> None:
    startup.set_cuda_connections()  # before CUDA starts
    check_version()
    startup.apply()
    arguments.apply()
    cpu.apply()
    hetero_init.apply()
    hetero_model.apply()
    hetero_optimizer.apply()
    hetero_data.apply()
    hetero_schedule.apply()
    checkpointing.apply()
    torch_adam.apply()
    grad_sync.apply()
    metrics.apply()
    faults.apply()
    rerun.apply()
    layer_specs.apply()
    rope.apply()
    loss.apply()
    grad_accum_fusion.apply()
    embedding_grad.apply()
    fa4_backward.apply()
    multi_tensor.apply()
    fused_adam.apply()
    moe_dispatch.apply()
    device_init.apply()


__all__ = ["apply", "PatchError"]
