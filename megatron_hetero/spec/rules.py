"""What megatron-hetero can run, each rule once: module layouts, model sizes, sequence lengths and
batch sizes.

Pure Python (no torch). Every rule returns the problem, one line naming the flag or layout field and
the fix, or None; `check` raises a caller's own error for the first problem. Callers:
training/args.py (the example script's flags), the planner (which layouts it lists) and the
boundary (which batches it plans). A layout file's own consistency is checked where it is parsed
(megatron_hetero.layout); the encoder kinds a script builds, by their registry (models/kinds.py).
"""

from __future__ import annotations

import math

from megatron_hetero.spec.layout import ColocatedSchedule, HeteroLayout, ModuleLayout, Placement
from megatron_hetero.spec.sizes import AUDIO_FRAMES_PER_TOKEN

__all__ = [
    "audio_frames_problem",
    "batch_problem",
    "check",
    "colocated_schedule_problem",
    "deepstack_problem",
    "deepstack_stages",
    "dp_split_problem",
    "edge_problem",
    "encoder_cp_problem",
    "encoder_microbatches_problem",
    "encoder_pp_problem",
    "experts_problem",
    "first_problem",
    "head_width_problem",
    "heads_problem",
    "llm_freeze_problem",
    "node_problem",
    "patch_problem",
    "prompt_problem",
    "sequence_multiple",
    "sequence_problem",
    "stages_problem",
]


def first_problem(*problems: str | None) -> str | None:
    return next((problem for problem in problems if problem), None)


def check(error: type[Exception], *problems: str | None) -> None:
    """Raises error(the first problem), if there is one."""
    problem = first_problem(*problems)
    if problem:
        raise error(problem)


# ---- module layouts ------------------------------------------------------------------------------


def edge_problem(encoder: ModuleLayout, llm: ModuleLayout) -> str | None:
    if encoder.role != "encoder" or llm.role != "llm":
        return f"edge {encoder.name} -> {llm.name}: an edge goes from an encoder into the llm; fix the edges list"
    return None


def deepstack_problem(layout: HeteroLayout, encoder: str, deepstack: tuple[int, ...]) -> str | None:
    """The DeepStack edges a layout lists (layered edges, layout.Edge) against the model's: encoder
    layer deepstack[j] into llm layer j. None listed: the model's are implied."""
    listed = {(e.src, e.src_layer, e.dst_layer) for e in layout.edges if e.layered}
    model = {(encoder, layer, j) for j, layer in enumerate(deepstack)}
    if not listed or listed == model:
        return None
    want = ", ".join(f"{encoder}[{layer}] -> {layout.llm.name}[{j}]" for j, layer in enumerate(deepstack))
    return (f"edges: the layout's DeepStack edges differ from the model's ({want or 'none'}); list exactly "
            f"those or none (then the model's are implied)")


def deepstack_stages(llm: ModuleLayout, encoder: str, deepstack: tuple[int, ...], num_layers: int) -> list[str]:
    """Per DeepStack edge (encoder layer deepstack[j] into llm layer j), the llm stage that adds it."""
    per_stage = num_layers // llm.pp
    return [f"{encoder}[{layer}] -> {llm.name}[{j}]: added on {llm.name} stage {j // per_stage}"
            for j, layer in enumerate(deepstack)]


def node_problem(module: ModuleLayout, gpus_per_node: int) -> str | None:
    """TP communicates in every layer: its ranks share a node's NVLink."""
    if module.tp > gpus_per_node:
        return (f"module {module.name}: tp={module.tp} spans more than a node's {gpus_per_node} GPUs; "
                f"use tp <= {gpus_per_node}")
    return None


def encoder_cp_problem(encoder: ModuleLayout, tokens: int | None, sizes: str = "") -> str | None:
    """An encoder's cp ranks split each item's tokens (an image's patches and class token, a clip's
    frames) into cp equal contiguous parts, its attention over all of them (`cp_replicated`: they
    replicate the item instead, Megatron's homogeneous layout under an LLM with CP). tokens: an
    item's tokens in the encoder; 0 for one that splits items of any size (a Qwen tower: by whole
    merge blocks, unevenly; Qwen2.5-Omni's audio encoder: by rows); None for one that does not split
    its items (InternVL's tower); sizes: the flags that set the tokens."""
    cp = encoder.sequence_cp
    if cp == 1 or tokens == 0:
        return None
    if tokens is None:
        return (f"module {encoder.name}: cp={cp} splits each item's tokens over cp ranks, which this model's "
                f"{encoder.kind} encoder does not; set cp: 1 and use dp for its ranks, or cp_replicated: true")
    if tokens % cp:
        divisors = ", ".join(str(d) for d in range(1, tokens + 1) if tokens % d == 0)
        return (f"module {encoder.name}: cp={cp} does not divide an item's {tokens} encoder tokens{sizes}; set cp: "
                f"to a divisor ({divisors}) or change the item size")
    return None


def encoder_pp_problem(encoder: ModuleLayout, placement: str) -> str | None:
    """Only an encoder on ranks of its own is pipelined; a colocated one (also the planner's
    "homogeneous" placement) runs whole before the LLM's stages."""
    if encoder.pp != 1 and placement != Placement.NON_COLOCATED:
        return (f"module {encoder.name}: a colocated encoder runs unpipelined beside every LLM stage; "
                f"set pp: 1 and use dp or tp for its ranks")
    return None


def colocated_schedule_problem(placement: str, llm: ModuleLayout, schedule: str,
                               encoders: tuple[ModuleLayout, ...] = ()) -> str | None:
    """--hetero-colocated-schedule orders a colocated rank's encoder work around a pipelined LLM's
    (schedules/colocated_order.py); elsewhere there is nothing to order. Its orders place each
    microbatch's encoder work on its own, so an encoder batched over microbatches (`microbatches`)
    runs under the recompute schedule."""
    if schedule == ColocatedSchedule.RECOMPUTE:
        return None
    if placement != Placement.COLOCATED or llm.pp == 1:
        return (f"--hetero-colocated-schedule {schedule} applies to colocated layouts with llm pp > 1 "
                f"(this one: {placement}, pp {llm.pp}); drop the flag")
    batched = next((e for e in encoders if e.microbatches > 1), None)
    if batched:
        return (f"module {batched.name}: microbatches: {batched.microbatches} runs under the recompute schedule, "
                f"not --hetero-colocated-schedule {schedule}; drop the flag or set microbatches: 1")
    return None


def encoder_microbatches_problem(encoder: ModuleLayout, num_microbatches: int) -> str | None:
    """An encoder batched over k LLM microbatches (layout `microbatches`) encodes whole groups of k."""
    k = encoder.microbatches
    if num_microbatches % k:
        return (f"module {encoder.name}: microbatches: {k} does not divide the step's {num_microbatches} llm "
                f"microbatches (--global-batch-size / (--micro-batch-size x llm dp)); use a divisor of "
                f"{num_microbatches}")
    return None


def llm_freeze_problem(llm: ModuleLayout) -> str | None:
    if llm.freeze:
        return f"module {llm.name}: freeze is for encoders here; remove it from the llm"
    return None


def experts_problem(llm: ModuleLayout, num_experts: int | None, topk: int) -> str | None:
    """Expert parallelism splits an MoE LLM's experts evenly; megatron-core's MoE layer trains
    tensor parallelism only with sequence parallelism."""
    if num_experts is None:
        if llm.has_expert_grid:
            return (f"module {llm.name}: ep={llm.ep} etp={llm.etp} lay out experts but the llm is dense; "
                    f"add --num-experts (a multiple of {llm.ep}) or remove ep and etp")
        return None
    if num_experts % llm.ep:
        return (f"--num-experts {num_experts} is not divisible by module {llm.name}'s ep={llm.ep}; "
                f"use a multiple of {llm.ep}")
    if not 1 <= topk <= num_experts:
        return f"--moe-router-topk {topk} must be between 1 and --num-experts {num_experts}"
    if llm.tp > 1 and not llm.sp:
        return (f"module {llm.name}: an MoE llm with tp={llm.tp} needs sequence parallelism (megatron-core's "
                f"MoE layer); set sp: true")
    return None


# ---- model sizes (`flag`: the flag or workload field that sets the size) --------------------------


def stages_problem(module: ModuleLayout, layers: int, flag: str) -> str | None:
    """The module's layers split evenly over its pipeline stages."""
    if layers < module.pp:
        return (f"module {module.name}: pp={module.pp} is more pipeline stages than {flag} {layers}; "
                f"use pp <= {layers}")
    if layers % module.pp:
        return (f"{flag} {layers} is not divisible by module {module.name}'s pp={module.pp}; "
                f"use a multiple of {module.pp}")
    return None


def heads_problem(module: ModuleLayout, heads: int, flag: str) -> str | None:
    """Attention heads (or key/value heads) split evenly over TP."""
    if heads % module.tp:
        divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        return (f"{flag} {heads} is not divisible by module {module.name}'s tp={module.tp}; set the module's "
                f"tp: to a divisor of {heads} ({divisors}) or use a multiple of {module.tp}")
    return None


def head_width_problem(hidden: int, hidden_flag: str, heads: int, heads_flag: str) -> str | None:
    if heads < 1 or hidden % heads:
        return f"{hidden_flag} {hidden} is not divisible by {heads_flag} {heads}; make it a multiple of the heads"
    return None


def audio_frames_problem(frames: int) -> str | None:
    if frames < AUDIO_FRAMES_PER_TOKEN or frames % AUDIO_FRAMES_PER_TOKEN:
        return (f"--audio-frames {frames} is not a positive multiple of {AUDIO_FRAMES_PER_TOKEN} (the audio "
                f"front end halves the frames twice)")
    return None


def patch_problem(image_size: int, patch_size: int) -> str | None:
    if patch_size < 1 or image_size % patch_size:
        return (f"--image-size {image_size} is not a multiple of --patch-size {patch_size}; "
                f"use a patch size that divides it")
    return None


# ---- sequence lengths ----------------------------------------------------------------------------


def sequence_multiple(llm: ModuleLayout) -> int:
    """The sequence lengths `llm` splits are the multiples of this: 2 x cp load-balanced CP chunks
    (with CP), and each CP rank's part into tp parts (with sequence parallelism)."""
    return math.lcm(2 * llm.cp if llm.cp > 1 else 1, llm.cp * llm.tp if llm.sp else 1)


def sequence_problem(seq_length: int, llm: ModuleLayout) -> str | None:
    """The fused sequence (--seq-length) splits over the LLM's CP chunks and SP parts."""
    if llm.cp > 1 and seq_length % (2 * llm.cp):
        return (f"--seq-length {seq_length} is not divisible by 2 x the llm's cp = {2 * llm.cp} (load-balanced "
                f"CP chunks); use a multiple of {sequence_multiple(llm)}")
    if llm.sp and (seq_length // llm.cp) % llm.tp:
        return (f"--seq-length {seq_length} / cp={llm.cp} is not divisible by the llm's tp={llm.tp} (sequence "
                f"parallelism); use a multiple of {sequence_multiple(llm)}")
    return None


def prompt_problem(seq_length: int, media_tokens: int, text_tokens: int, per_sequence: int = 1) -> str | None:
    """A sample is <bos>, its image/audio tokens, its text and <eos> (data/batches.py); a packed
    sequence holds `per_sequence` of them (--pack-samples)."""
    needed = per_sequence * (1 + media_tokens + text_tokens + 1)
    if seq_length < needed:
        packed = f" {per_sequence} times (--pack-samples {per_sequence})" if per_sequence > 1 else ""
        return (f"--seq-length {seq_length} cannot hold <bos>, {media_tokens} image/audio tokens, the longest "
                f"caption and <eos>{packed}; use --seq-length {needed} or more")
    return None


# ---- batch sizes ---------------------------------------------------------------------------------


def dp_split_problem(what: str, samples: int, module: ModuleLayout) -> str | None:
    """`samples` (described by `what`, e.g. '--eval-samples 6') split evenly over the module's DP ranks."""
    if samples % module.dp:
        return f"{what} is not divisible by module {module.name}'s dp={module.dp}; use a multiple of {module.dp}"
    return None


def batch_problem(global_batch: int, micro_batch: int, llm: ModuleLayout) -> str | None:
    """A step is whole microbatches of micro_batch samples per LLM DP rank. The encoders take the
    microbatch's items by cost (boundary/balance.py), so their dp need not divide it: an encoder DP
    rank may get no item."""
    per_step = micro_batch * llm.dp
    if global_batch % per_step:
        return (f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size x llm dp = "
                f"{per_step}; use a multiple of {per_step}")
    return None
