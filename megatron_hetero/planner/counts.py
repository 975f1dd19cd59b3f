"""Standard transformer counts: parameters, FLOPs and activation bytes of a module shape (an MoE
LLM's layers hold every expert and compute with the `topk` each token goes to)."""

from __future__ import annotations

from megatron_hetero.planner.shapes import GPU_ARCH_MAJOR, ModuleShape, Workload
from megatron_hetero.spec.sizes import MLP_MIN_MACS, grouped_experts_problem

# Bytes per parameter kept on a GPU under Megatron's --bf16 (the trainer on GPUs since 2026-11-24):
# bf16 weights in the model, fp32 gradients reduced in fp32, fp32 main params and AdamW moments in the
# optimizer (the distributed optimizer shards the last two). With fp32 weights (--fp32, and records
# from before: fp32 weights under bf16 autocast) the weights are the main params.
WEIGHT_BYTES = 2
MAIN_PARAM_BYTES = 4
GRADIENT_BYTES = 4
ADAM_BYTES = 8


def optimizer_bytes(weight_bytes: int) -> int:
    """Bytes per trainable parameter the optimizer keeps (shardable): fp32 main params unless the
    weights are fp32 themselves, and the two AdamW moments."""
    return ADAM_BYTES + (MAIN_PARAM_BYTES if weight_bytes < MAIN_PARAM_BYTES else 0)
# Bytes per logit at the loss: the output layer's bf16 logits and the loss's fp32 copy of them
# (megatron-core's vocab_parallel_cross_entropy, which keeps the fp32 one, as its softmax, for the
# backward) are alive together while the loss runs, at the end of the forward: the step's peak.
LOGIT_BYTES = 6
# Under Megatron's --cross-entropy-loss-fusion, megatron-core's native fused cross entropy (compiled by
# torch.compile) holds one more fp32 copy of the logits while the loss runs: measured on one H200, the
# peak grows by 4 bytes per logit (4.6 GiB at 8192 tokens of a 152064 vocabulary).
FUSED_LOGIT_BYTES = LOGIT_BYTES + 4
# quack's cross entropy in its place (models/loss_kernels.py, the whole vocabulary on one rank) keeps the
# bf16 logits and, while its backward writes it, their bf16 gradient: 4 bytes per logit at the start of
# the backward, when every activation is still held (by its allocations, not yet a measured peak).
QUACK_LOGIT_BYTES = 4


def bytes_per_logit(fused: bool, quack: bool, tp: int) -> int:
    """Bytes per logit the loss holds: megatron-core's cross entropy (`fused`: its native fused one) or,
    with `quack` where it runs (the vocabulary not split over TP), quack's."""
    if quack and tp == 1:
        return QUACK_LOGIT_BYTES
    return FUSED_LOGIT_BYTES if fused else LOGIT_BYTES


def mlp_params(shape: ModuleShape) -> int:
    """One MLP (one expert of an MoE layer): 2 or, gated, 3 hidden x ffn matrices."""
    return (3 if shape.gated_mlp else 2) * shape.hidden * shape.ffn


def expert_layer_params(shape: ModuleShape) -> int:
    """The experts of one MoE layer (0 for a dense layer): split over EP and expert TP."""
    return shape.experts * mlp_params(shape)


def layer_params(shape: ModuleShape, active: bool = False) -> int:
    """Weights of one transformer layer: Q and output projections (hidden x heads x head size each),
    K and V (hidden x kv_dim each), the MLP, or an MoE layer's router (hidden x experts) and its
    experts (every one; with `active`, the topk a token computes with). Biases and norms are left
    out (well under 1%)."""
    attention = 2 * shape.hidden * shape.q_dim + 2 * shape.hidden * shape.kv_dim
    if not shape.experts:
        return attention + mlp_params(shape)
    experts = shape.topk if active else shape.experts
    return attention + shape.hidden * shape.experts + experts * mlp_params(shape)


def projector_params(shape: ModuleShape, llm_hidden: int) -> int:
    """One projector of an encoder into the LLM hidden size, whose input is the concatenation of the
    tokens pixel shuffle (or a patch merger) merges into one row (or `projector_input` wide)."""
    width_in = shape.projector_input or shape.hidden * (shape.tokens_per_item // shape.rows_per_item)
    if shape.projector_ffn:
        return width_in * shape.projector_ffn + shape.projector_ffn * llm_hidden
    return width_in * llm_hidden


def head_params(shape: ModuleShape, llm_hidden: int) -> int:
    """Weights outside the layers: the LLM's input embedding and output layer (one matrix where they
    are tied); an encoder's patch embedding (or other front end), its projector and DeepStack's."""
    if shape.role == "llm":
        return (1 if shape.tied_embeddings else 2) * shape.vocab * shape.hidden
    return shape.row_width * projector_params(shape, llm_hidden) + shape.patch_dim * shape.hidden + shape.front_params


def module_params(shape: ModuleShape, llm_hidden: int) -> int:
    return shape.layers * layer_params(shape) + head_params(shape, llm_hidden)


def attended_tokens(shape: ModuleShape) -> float:
    """Keys one query attends to on average: the shape's `attention_keys` where given, else its
    whole item for an encoder (bidirectional), half the sequence for the causal LLM (assumes the
    attention kernel skips fully masked blocks, as flash attention and SDPA's causal path do)."""
    if shape.attention_keys:
        return shape.attention_keys
    return shape.layer_tokens_per_item if shape.role == "encoder" else shape.seq_length / 2


def _window_sides(side: int, window: int) -> list[int]:
    """The lengths of the windows cutting one side of `side` units, `window` each (the last shorter)."""
    return [min(window, side - start) for start in range(0, side, window)]


def window_attention_keys(grids: list[tuple[int, int]], window: int, merge: int, full_layers: int,
                          layers: int) -> float:
    """Keys a query attends to, averaged over the tokens and layers, in a ViT whose items are
    patch grids (h, w) of different sizes (native resolution), each attending to itself in
    `full_layers` layers and within windows of window x window patches in the others (Qwen2.5-VL:
    windows cut the grid of merge x merge blocks, so `window` is a multiple of `merge`): sum over
    segments of length^2, over the tokens."""
    tokens = sum(h * w for h, w in grids)
    windowed = sum(n * n for n in window_lengths(grids, window))
    return (full_layers * item_attention_keys(grids) + (layers - full_layers) * windowed / tokens) / layers


def window_lengths(grids: list[tuple[int, int]], window: int) -> list[int]:
    """The tokens of each window of a windowed layer, in the layers' order: the windows of window x
    window patches of each item (h, w) by rows (Qwen2.5-VL's window index; the last of a row or
    column shorter)."""
    return [a * b for h, w in grids for a in _window_sides(h, window) for b in _window_sides(w, window)]


# Q-wide tensors a packed RoPE tower's attention keeps where V reaches the kernel as a view of the QKV
# GEMM's output (no padding, no permutation copies it): that output whole, its Q and K parts beside
# the rotated Q and K (as many key as query heads, as in the Qwen towers).
QKV_VIEW_COPIES = 2


def packed_sdpa_copies(layer_segments: list[list[int]]) -> float:
    """Q-wide tensors a packed encoder layer on SDPA (models/varlen.py, _varlen_sdpa) keeps beyond Q,
    K, V and its output, averaged over the layers, each given as its segments' token counts in the
    layers' order: where the segments have several lengths (one call each), the output projection's
    input is a copy of the calls' outputs (1); where they already lie by length, no permutation copies
    Q, K and V (QKV_VIEW_COPIES)."""
    kept = [(len(set(lengths)) > 1) + QKV_VIEW_COPIES * (lengths == sorted(lengths)) for lengths in layer_segments]
    return sum(kept) / len(kept)


def item_attention_keys(grids: list[tuple[int, int]]) -> float:
    """Keys a query attends to, averaged over the tokens, in a ViT whose items of h x w patches each
    attend to themselves (native resolution without windows: Qwen3-VL)."""
    return sum((h * w) ** 2 for h, w in grids) / sum(h * w for h, w in grids)


def layer_forward_flops_per_token(shape: ModuleShape) -> float:
    """2 FLOPs (one multiply-add) per weight a token computes with (an MoE layer: its topk experts),
    plus attention: Q K^T and the weighted sum of V, each 2 x attended keys x heads x head size."""
    return 2 * layer_params(shape, active=True) + 4 * attended_tokens(shape) * shape.q_dim


def head_forward_flops_per_sample(shape: ModuleShape, llm_hidden: int) -> float:
    """The LLM's output layer on every position (the input embedding is a lookup); an encoder's
    patch embedding on every patch (or its other front end on every item), its projectors (main and
    DeepStack) on every row it sends."""
    if shape.role == "llm":
        return 2 * shape.vocab * shape.hidden * shape.seq_length
    patches = shape.items_per_sample * shape.tokens_per_item
    return 2 * (shape.row_width * projector_params(shape, llm_hidden) * shape.rows_per_sample
                + shape.patch_dim * shape.hidden * patches + shape.front_macs_per_item * shape.items_per_sample)


def module_forward_flops_per_sample(shape: ModuleShape, llm_hidden: int) -> float:
    layers = shape.layers * layer_forward_flops_per_token(shape) * shape.tokens_per_sample
    return layers + head_forward_flops_per_sample(shape, llm_hidden)


def model_flops_per_step(workload: Workload) -> float:
    """FLOPs one step must do (forward + backward = 3 x forward; a frozen module 1 x forward);
    recomputation is not counted: TFLOPS/GPU figures compare layouts on the same work."""
    total = 0.0
    for shape in workload.modules:
        passes = 1 if shape.frozen else 3
        total += passes * module_forward_flops_per_sample(shape, workload.llm.hidden)
    return total * workload.global_batch


def mlp_runs_fused(shape: ModuleShape, tokens: float, tp: int, fused_mlp: bool,
                   fused_gated_bias: bool = False) -> bool:
    """Whether a layer's MLP call of `tokens` tokens (a microbatch's on one rank, before sequence
    parallelism splits them) runs on quack's GEMM epilogues (models/mlp.py) where the workload's
    MLPs do (`fused_mlp`): a dense MLP, a gated one in the LLM, the gated encoder here (Qwen2.5-VL's
    tower, with fc1 biases) only where its bias layout passed its check (`fused_gated_bias`), not
    experts, and under auto only where fc1's GEMM is at least MLP_MIN_MACS multiply-adds (spec/sizes.py)."""
    if not fused_mlp or shape.experts or (shape.gated_mlp and shape.role != "llm" and not fused_gated_bias):
        return False
    fc1_width = shape.ffn * (2 if shape.gated_mlp else 1) / tp
    return tokens * shape.hidden * fc1_width >= MLP_MIN_MACS[0]


def experts_run_grouped(shape: ModuleShape, tp: int, ep: int, weight_bytes: int, grouped_experts: bool) -> bool:
    """Whether an MoE layer's experts run on torch's grouped GEMMs (models/experts.py) where the
    workload's do (`grouped_experts`): SwiGLU experts, more than one on each EP rank, and the kernel
    policy's auto rule (spec/sizes.grouped_experts_problem) on the planner's GPUs, for the workload's
    weights and the per-rank GEMM widths (split over expert TP, `tp`)."""
    if not (grouped_experts and shape.experts and shape.gated_mlp and shape.experts // ep > 1):
        return False
    widths = (shape.hidden, 2 * shape.ffn // tp, shape.ffn // tp)
    return grouped_experts_problem(GPU_ARCH_MAJOR, weight_bytes == WEIGHT_BYTES, widths) is None


def grouped_experts_transient_bytes(shape: ModuleShape, tp: int, ep: int, dtype_bytes: int) -> int:
    """The most bytes one MoE layer's grouped experts hold at once beyond SequentialMLP's, on one GPU:
    in fc1's backward (models/experts.py, _GroupedLinear.backward) the weight gradient of every local
    expert from one grouped GEMM ([experts / ep, 2 ffn / tp, hidden] in the activations' dtype) and,
    under gradient-accumulation fusion (the trainer's default), its copies in main_grad's fp32, made
    before they are added, alive together. The rest is smaller and freed before: fc2's, the stacked
    weight copies of the forward and the input-gradient GEMM (where the distributed optimizer places
    the parameters apart: one weight-dtype copy), DDP's placeholders after the add. SequentialMLP's
    transients, one expert at a time, are left out as every linear's are."""
    return (shape.experts // ep) * (2 * shape.ffn // tp) * shape.hidden * (dtype_bytes + GRADIENT_BYTES)


def activation_bytes_per_token_layer(shape: ModuleShape, tp: int, sp: bool, dtype_bytes: int,
                                     fused: bool = False, run_head_dim: int = 0, kernel: str = "") -> float:
    """Activations one layer keeps per token for its backward, on one GPU, without recomputation
    (Korthikanti et al. 2022, "Reducing Activation Recomputation", with dropout off and a fused
    attention kernel that keeps no seq x seq scores):
    - the two norm inputs and the two norm outputs that feed the QKV and FC1 GEMMs (4 x hidden),
      whole on every TP rank unless sequence parallelism splits them;
    - Q, K, V, the attention output, the FC1 output(s) and the activation output, split by TP; an
      MLP that runs `fused` (mlp_runs_fused) keeps no activation output (its fc2 input-gradient GEMM
      recomputes it: models/mlp.py);
    - attention run at a zero-padded head dim (`run_head_dim` above the shape's: flash-attn-4 at an
      unchecked one) keeps Q, K, V and its output padded, and the output projection an unpadded copy;
    - attention in a packed encoder: the shape's `packed_sdpa_copies` on SDPA (`kernel` "sdpa"), its
      `packed_fa4_copies` on flash-attn-4 at the true head dim;
    - layer scale (`layer_scale`): the attention and MLP outputs it scales (2 x hidden, as the norms'
      tensors split by sequence parallelism only);
    - an MoE layer: its topk experts' MLP tensors, and the dispatcher's topk copies of each token
      (the experts' fc1 inputs, kept for their weight gradients) and of the experts' outputs (kept
      by the unpermutation's weighting with the router's probabilities)."""
    replicated = (6 if shape.layer_scale else 4) * shape.hidden
    mlp_tensors = (3 if shape.gated_mlp else 2) - fused
    topk = max(shape.topk, 1)
    attention = 2 * shape.q_dim + 2 * shape.kv_dim
    if run_head_dim > shape.head_size:
        attention = 2 * (shape.heads + shape.kv_groups) * run_head_dim + shape.q_dim
    if kernel == "sdpa":
        attention += shape.packed_sdpa_copies * shape.q_dim
    elif kernel == "fa4" and run_head_dim <= shape.head_size:
        attention += shape.packed_fa4_copies * shape.q_dim
    dispatched = 2 * shape.topk * shape.hidden
    split = attention + mlp_tensors * shape.ffn * topk + dispatched
    return dtype_bytes * ((replicated / tp if sp else replicated) + split / tp)
