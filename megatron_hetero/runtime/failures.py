"""What a failing rank says: the phase it is in, in words (its heartbeats carry it: watchdog.py), and
out of GPU memory, one line per rank instead of a multi-page traceback each.

The rank that ran out says where (the module and the phase: the step's innermost named phase,
PhaseTimers), how much it held at its peak against the GPU's capacity, and what uses less memory
for this run: first the allocator setting where torch's cache fragmented, then the flags it does
not use yet (recomputation, the distributed optimizer, a smaller micro batch, another layout; and a launcher's own
advice, e.g. bench_e2e's planner answer for its workload). patches/faults.py
records the line as the job's fault, so that every other rank stops with one line too
(runtime/watchdog.py).
"""

import os
import re

import torch

# The schedules' phases (PhaseTimers names) as a failure report says them.
PHASE_WORDS = {"encoder-forward": "an encoder's forward", "encoder-backward": "an encoder's backward",
               "boundary": "the boundary", "llm-forward": "the LLM pipeline", "llm-backward": "the LLM pipeline"}
# The same phases with the module named.
_MODULE_PHASES = {"encoder-forward": "forward", "encoder-backward": "backward", "llm-forward": "forward",
                  "llm-backward": "backward"}
GIB = 2**30
EXPANDABLE = "expandable_segments:True"  # PYTORCH_CUDA_ALLOC_CONF: segments that grow, no fragments
# Sizes in torch's out-of-memory message: the failed allocation, the cache's reserved-but-unused part.
_TRIED = re.compile(r"Tried to allocate ([\d.]+) ([KMGT])iB")
_IDLE = re.compile(r"([\d.]+) ([KMGT])iB is reserved by PyTorch but unallocated")
_IN_USE = re.compile(r"this process has ([\d.]+) ([KMGT])iB memory in use")
_ALLOCATED = re.compile(r"Of the allocated memory ([\d.]+) ([KMGT])iB is allocated by PyTorch")


def current_phase(run) -> str:
    """What this rank is doing now, in words: a schedule's phase, else the run's coarse phase."""
    model = run.handles.model
    phase = model.timers.current if model is not None else None
    return PHASE_WORDS.get(phase, phase) if phase else run.handles.phase


def _where(run) -> str:
    timers = run.handles.model.timers if run.handles.model is not None else None
    phase, module = (timers.current, timers.current_module) if timers is not None else (None, None)
    if module is not None and phase in _MODULE_PHASES:
        return f"module {module}'s {_MODULE_PHASES[phase]}"
    return current_phase(run)


def _gib(size: re.Match | None) -> float | None:
    """A size torch's message wrote ("1024.00 MiB") in GiB, or None."""
    if size is None:
        return None
    return float(size.group(1)) * 1024.0 ** ("KMGT".index(size.group(2)) - 2)


def fragmentation_hint(error: BaseException, environ=os.environ) -> str | None:
    """The allocator setting to try first where torch's message says more memory sat reserved but
    unallocated than the failed allocation asked for (the cache fragmented: at W6's 64K tokens on an
    80 GB H100, 13 GiB idle beside a failed 1 GiB; docs/benchmarks.md); None otherwise or when set."""
    message = str(error)
    tried, idle = _gib(_TRIED.search(message)), _gib(_IDLE.search(message))
    if tried is None or idle is None or idle < tried or EXPANDABLE in environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return None
    return f"PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} ({idle:.1f} GiB sat reserved but unallocated: fragmented)"


def outside_allocator_gib(error: BaseException) -> float | None:
    """What this process held outside PyTorch's allocator when it ran out (NCCL's buffers, the CUDA
    context, library workspaces), in GiB, from torch's message: in use less allocated less cached.
    None where the message does not say (W6 on an H100 ran out with ~10 GiB beyond its peak allocation)."""
    message = str(error)
    in_use, allocated, idle = (_gib(p.search(message)) for p in (_IN_USE, _ALLOCATED, _IDLE))
    if in_use is None or allocated is None:
        return None
    return max(0.0, in_use - allocated - (idle or 0.0))


def _usage(error: BaseException) -> str:
    """This GPU's peak and capacity, the allocation that failed and, where it is 1 GiB or more, what
    was held outside PyTorch's allocator (from torch's message)."""
    tried = _TRIED.search(str(error))
    tried = f"; tried to allocate {tried.group(1)} {tried.group(2)}iB" if tried else ""
    outside = outside_allocator_gib(error)
    if outside is not None and outside >= 1.0:
        tried += f"; {outside:.1f} GiB held outside PyTorch's allocator"
    if not torch.cuda.is_available():
        return tried.removeprefix("; ")
    device = torch.cuda.current_device()
    peak, total = torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
    return f"peak {peak / GIB:.1f} GiB allocated of the GPU's {total / GIB:.1f} GiB{tried}"


def memory_flags(args, layout) -> list[str]:
    """The flags that would use less memory, of those this run does not use yet."""
    flags = []
    if not args.recompute_granularity:
        flags.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    if not args.use_distributed_optimizer and any(m.dp * m.cp > 1 for m in layout.modules if not m.freeze):
        flags.append("--use-distributed-optimizer")
    if args.micro_batch_size > 1:
        flags.append(f"--micro-batch-size {args.micro_batch_size // 2}")
    flags.append("a layout with more tp, pp (or cp) for that module")
    return flags


def out_of_memory_line(error: BaseException, run, args) -> str:
    """The one line (without "error: rank R stopped in ...", which the watchdog adds) that says where
    this rank ran out of GPU memory and what uses less."""
    hint = fragmentation_hint(error)
    advice = ([hint] if hint else []) + memory_flags(args, run.layout)
    if run.handles.memory_advice is not None:
        advice.append(run.handles.memory_advice())
    usage = _usage(error)
    return (f"out of GPU memory in {_where(run)}{f' ({usage})' if usage else ''}; to use less memory: "
            + "; ".join(advice))
