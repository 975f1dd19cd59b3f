"""Workloads as the planner sees them: each module's shape and work per sample, the workload's batch
and options, and the cluster it runs on."""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_hetero.spec.json_file import load_json

# nvidia-smi on an H200: 143771 MiB. An H100 80GB: torch's total_memory, 79.18 GiB (nvidia-smi
# 81559 MiB), which bench_e2e records as device_memory_gib: runs before and after that field group as one.
H200_MEMORY_GB = 150.7
H100_MEMORY_GB = 85.0
# The GPUs the planner models (H100 and H200: its calibrations) are Hopper, compute capability 9.x.
GPU_ARCH_MAJOR = 9


ATTENTION_KERNELS = ("fa4", "sdpa")  # the kernels models/attention_kernels.py chooses between


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


CP_SPLITS = ("tokens", "blocks", "none")  # ModuleShape.cp_split


@dataclass(frozen=True)
class ModuleShape:
    """A module's size and its work per sample.

    Encoders: `tokens_per_item` tokens (on average) run through the encoder per image or clip, `items_per_sample`
    items per sample, `output_tokens_per_item` rows per item enter the LLM (fewer than the tokens
    with pixel shuffle; 0: as many), through an MLP projector of hidden width `projector_ffn` (0: a
    linear projection) whose input is `projector_input` wide (0: the tokens merged into a row side by
    side, hidden x tokens per row; an encoder that averages them into a row: its hidden);
    `class_tokens` more tokens per item run through the layers but not into the projector
    (InternViT's class token); `patch_dim` values per patch token feed the input embedding
    (0: the embedding is left out), or a front end other than one linear map per token feeds it:
    `front_params` weights doing `front_macs_per_item` multiply-adds per item (Qwen3-Omni's audio
    convolutions over whole chunks); `deepstack` more projectors of the same shape run on every row
    (Qwen3-VL's DeepStack mergers), whose rows cross the boundary beside the main ones. The LLM:
    `seq_length` tokens per sample, `vocab` output classes (`tied_embeddings`: its output layer is
    its input embedding, one matrix of weights); with `experts` > 0 its MLPs are
    mixture-of-experts layers: `experts` MLPs of width `ffn` each, every token through `topk` of
    them. Attention heads are `head_dim` wide where given (else hidden / heads)."""

    name: str
    role: str
    hidden: int
    layers: int
    heads: int
    ffn: int
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    gated_mlp: bool = False  # SwiGLU-style MLP: three hidden x ffn matrices instead of two
    tokens_per_item: int = 0
    items_per_sample: int = 0
    output_tokens_per_item: int = 0
    projector_ffn: int = 0
    projector_input: int = 0
    seq_length: int = 0
    vocab: int = 0
    tied_embeddings: bool = False
    frozen: bool = False
    experts: int = 0  # 0: a dense MLP
    topk: int = 0
    head_dim: int = 0  # attention head size; 0: hidden / heads (Qwen3's 128 with hidden 2048, 32 heads differs)
    class_tokens: int = 0
    patch_dim: int = 0
    front_params: int = 0
    front_macs_per_item: float = 0.0
    deepstack: int = 0
    # Keys a query attends to, averaged over the tokens and layers (counts.window_attention_keys:
    # items of several sizes, windowed layers); 0: its whole item (encoders), half the sequence (the llm).
    attention_keys: float = 0.0
    # How the encoder's CP ranks split an item: "tokens" into equal parts, which cp must divide
    # (this project's encoders); "blocks" by whole merge blocks (rows), any item size (the Qwen
    # towers; Qwen2.5-Omni's audio encoder); "none": they do not (InternVL's tower and Qwen3-Omni's
    # audio encoder train with cp 1).
    cp_split: str = "tokens"
    # The attention and MLP outputs scaled per channel before the residual add (InternViT's layer
    # scale), whose backward keeps each of them.
    layer_scale: bool = False
    # Q-wide tensors a packed layer keeps beyond Q, K, V and the output, averaged over the layers, on
    # SDPA (counts.packed_sdpa_copies) and on flash-attn-4 at the true head dim (the native-resolution
    # towers: the QKV GEMM's output, which V's view holds beside the rotated Q and K).
    packed_sdpa_copies: float = 0.0
    packed_fa4_copies: float = 0.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"module name must be a non-empty string, got {self.name!r}")
        where = f"module {self.name}"
        for key in ("gated_mlp", "frozen", "tied_embeddings", "layer_scale"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{where}: {key} must be true or false, got {getattr(self, key)!r}")
        if self.role not in ("encoder", "llm"):
            raise ValueError(f"{where}: role {self.role!r} is not valid; use encoder or llm")
        for key in ("hidden", "layers", "heads", "ffn"):
            if not positive_int(getattr(self, key)):
                raise ValueError(f"{where}: {key} must be a positive integer, got {getattr(self, key)!r}")
        for key in ("kv_heads", "tokens_per_item", "items_per_sample", "output_tokens_per_item",
                    "projector_ffn", "projector_input", "seq_length", "vocab", "experts", "topk", "head_dim",
                    "class_tokens", "patch_dim", "front_params", "deepstack"):
            value = getattr(self, key)
            if not (positive_int(value) or value == 0):
                raise ValueError(f"{where}: {key} must be a non-negative integer, got {value!r}")
        if self.cp_split not in CP_SPLITS:
            raise ValueError(f"{where}: cp_split {self.cp_split!r} is not one of {', '.join(CP_SPLITS)}")
        for key in ("attention_keys", "front_macs_per_item", "packed_sdpa_copies", "packed_fa4_copies"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{where}: {key} must be a non-negative number, got {value!r}")
        if self.experts and not 1 <= self.topk <= self.experts:
            raise ValueError(f"{where}: topk {self.topk} must be between 1 and experts {self.experts}")
        if self.experts and self.role != "llm":
            raise ValueError(f"{where}: experts are for the llm; encoders are dense")
        if self.hidden % self.heads and not self.head_dim:
            raise ValueError(f"{where}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv_groups:
            raise ValueError(f"{where}: heads {self.heads} are not divisible by kv_heads {self.kv_heads}")
        if self.role == "encoder":
            if not self.tokens_per_item:
                raise ValueError(f"{where}: an encoder needs tokens_per_item > 0")
            if self.tokens_per_item % self.rows_per_item:
                raise ValueError(f"{where}: output_tokens_per_item {self.output_tokens_per_item} does not "
                                 f"divide tokens_per_item {self.tokens_per_item}")
        else:
            if not self.seq_length:
                raise ValueError(f"{where}: the llm needs seq_length > 0")
            if self.frozen:
                raise ValueError(f"{where}: freezing is for encoders; the llm trains")

    @property
    def kv_groups(self) -> int:
        return self.kv_heads or self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): key/value heads x head size."""
        return self.kv_groups * self.head_size

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of Q (and of the attention output): heads x head size."""
        return self.heads * self.head_size

    @property
    def rows_per_item(self) -> int:
        """Encoder rows one item sends into the LLM sequence."""
        return self.output_tokens_per_item or self.tokens_per_item

    @property
    def tokens_per_sample(self) -> int:
        """Tokens the module's layers run per sample."""
        return self.seq_length if self.role == "llm" else self.items_per_sample * self.layer_tokens_per_item

    @property
    def layer_tokens_per_item(self) -> int:
        """Tokens one item runs through the layers: its patches and class tokens."""
        return self.tokens_per_item + self.class_tokens

    @property
    def rows_per_sample(self) -> int:
        return self.items_per_sample * self.rows_per_item

    @property
    def row_width(self) -> int:
        """A boundary row's width in LLM hidden sizes: the main row and the DeepStack rows."""
        return 1 + self.deepstack


@dataclass(frozen=True)
class Workload:
    encoders: tuple[ModuleShape, ...]
    llm: ModuleShape
    global_batch: int
    micro_batch: int = 0  # samples per LLM DP rank per microbatch; 0: the planner picks
    dtype_bytes: int = 2  # activations and boundary rows (bf16)
    weight_bytes: int = 2  # per weight in the model: 2 under Megatron's --bf16, 4 with fp32 weights
    distributed_optimizer: bool = False
    # Candidates may also use Megatron's activation recomputation (--recompute-granularity full,
    # block method): the first k layers of each stage keep only their input and rerun their forward
    # in the backward; the planner takes the fewest k that fit (candidates.Recompute).
    allow_recompute: bool = False
    # MLPs run with the activation in quack's GEMM epilogues (models/mlp.py, on Hopper/Blackwell GPUs
    # with the `fa4` extra) where auto runs them so (counts.mlp_runs_fused): no activation output kept.
    fused_mlp: bool = False
    # With fused_mlp, a gated encoder MLP with fc1 biases (Qwen2.5-VL's ViT) too: quack's epilogues run
    # it where `megatron-hetero kernels check mlp` passed on the GPU model (gated_bias_mlp_checked).
    fused_gated_bias_mlp: bool = False
    # An MoE LLM's experts on torch's grouped GEMMs where the kernel policy's auto runs them so
    # (counts.experts_run_grouped): the trainer's default. False: SequentialMLP
    # (MEGATRON_HETERO_EXPERTS_KERNEL=sequential, and runs from before the grouped experts).
    grouped_experts: bool = True
    # The loss on megatron-core's native fused cross entropy (Megatron's --cross-entropy-loss-fusion,
    # off by default): the logits at counts.FUSED_LOGIT_BYTES each.
    fused_cross_entropy: bool = False
    # That loss on quack's cross entropy where it runs (models/loss_kernels.py: the vocabulary not split
    # over TP; elsewhere megatron-core's fused one): the logits at counts.QUACK_LOGIT_BYTES each.
    quack_cross_entropy: bool = False
    # The attention kernel each module runs, where known: (module name, kernel, head dim it runs at),
    # kernel "fa4" or "sdpa" (models/attention_kernels.py; fa4 runs an unchecked head dim zero-padded
    # to a checked one). A module not listed: not known, the planner's default (no padding).
    attention: tuple[tuple[str, str, int], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "encoders", tuple(self.encoders))
        object.__setattr__(self, "attention", tuple(tuple(e) if isinstance(e, (list, tuple)) else (e,)
                                                    for e in self.attention))
        if self.llm.role != "llm":
            raise ValueError(f"module {self.llm.name}: the workload's llm must have role llm")
        names = [self.llm.name]
        for encoder in self.encoders:
            if encoder.role != "encoder":
                raise ValueError(f"module {encoder.name}: listed as an encoder but its role is {encoder.role}")
            if encoder.name in names:
                raise ValueError(f"module {encoder.name}: named twice; give each module its own name")
            names.append(encoder.name)
        if not positive_int(self.global_batch):
            raise ValueError(f"global batch must be a positive integer, got {self.global_batch!r}")
        if not (positive_int(self.micro_batch) or self.micro_batch == 0):
            raise ValueError(f"micro batch must be a positive integer (or 0: let the planner pick), "
                             f"got {self.micro_batch!r}")
        for key in ("distributed_optimizer", "allow_recompute", "fused_mlp", "fused_gated_bias_mlp",
                    "grouped_experts", "fused_cross_entropy", "quack_cross_entropy"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false, got {getattr(self, key)!r}")
        if self.quack_cross_entropy and not self.fused_cross_entropy:
            raise ValueError("quack_cross_entropy replaces the fused loss: set fused_cross_entropy true as well "
                             "(plan --fused-cross-entropy; Megatron's --cross-entropy-loss-fusion)")
        for key in ("dtype_bytes", "weight_bytes"):
            if getattr(self, key) not in (2, 4):
                raise ValueError(f"{key} must be 2 (bf16) or 4 (fp32), got {getattr(self, key)!r}")
        self._check_attention()
        rows = sum(e.rows_per_sample for e in self.encoders)
        if rows >= self.llm.seq_length:
            raise ValueError(f"{rows} encoder rows per sample do not fit the llm's seq_length "
                             f"{self.llm.seq_length} with any text; raise seq_length or lower items_per_sample")

    def _check_attention(self) -> None:
        shapes = {shape.name: shape for shape in self.modules}
        for entry in self.attention:
            if len(entry) != 3 or entry[0] not in shapes or entry[1] not in ATTENTION_KERNELS:
                raise ValueError(f"attention entry {list(entry)}: give [module, kernel, head dim], module one of "
                                 f"{', '.join(shapes)}, kernel one of {', '.join(ATTENTION_KERNELS)}")
            if not positive_int(entry[2]) or entry[2] < shapes[entry[0]].head_size:
                raise ValueError(f"attention entry {list(entry)}: the head dim it runs at must be at least "
                                 f"module {entry[0]}'s {shapes[entry[0]].head_size}")

    @property
    def modules(self) -> tuple[ModuleShape, ...]:
        return (*self.encoders, self.llm)

    def attention_of(self, module: str) -> tuple[str, int]:
        """(kernel, head dim it runs at) of a module's attention; ("", 0) where not known."""
        return next(((kernel, dim) for name, kernel, dim in self.attention if name == module), ("", 0))

    @classmethod
    def from_dict(cls, data: dict) -> Workload:
        """{"encoders": [{ModuleShape fields but role}, ...], "llm": {...}, "global_batch": N, and
        optionally micro_batch, dtype_bytes, weight_bytes, distributed_optimizer, allow_recompute,
        fused_mlp, fused_gated_bias_mlp, grouped_experts, fused_cross_entropy, quack_cross_entropy,
        attention}."""
        if not isinstance(data, dict):
            raise ValueError(f"workload must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"workload: unknown key {key!r}; known keys: {', '.join(sorted(known))}")
        for key in ("encoders", "llm", "global_batch"):
            if key not in data:
                raise ValueError(f"workload: {key} missing")
        if not isinstance(data["encoders"], list):
            raise ValueError("workload: encoders must be a list of module shapes")
        shape_keys = {f.name for f in fields(ModuleShape)} - {"role"}

        def shape(spec, role: str) -> ModuleShape:
            if not isinstance(spec, dict):
                raise ValueError(f"workload: a module shape must be an object, got {spec!r}")
            for key in spec:
                if key not in shape_keys:
                    raise ValueError(f"workload: module {spec.get('name', '?')}: unknown key {key!r}; "
                                     f"known keys: {', '.join(sorted(shape_keys))}")
            missing = [key for key in ("name", "hidden", "layers", "heads", "ffn") if key not in spec]
            if missing:
                raise ValueError(f"workload: module {spec.get('name', role)}: {', '.join(missing)} missing")
            return ModuleShape(role=role, **spec)

        rest = {k: v for k, v in data.items() if k not in ("encoders", "llm")}
        return cls(tuple(shape(e, "encoder") for e in data["encoders"]), shape(data["llm"], "llm"), **rest)

    @classmethod
    def load(cls, path: str) -> Workload:
        return load_json(path, "workload", cls.from_dict)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_gb: float
    gpus_per_node: int = 8  # ranks are numbered node by node

    def __post_init__(self):
        if not positive_int(self.gpus):
            raise ValueError(f"gpus must be a positive integer, got {self.gpus!r}")
        if not positive_int(self.gpus_per_node):
            raise ValueError(f"gpus per node must be a positive integer, got {self.gpus_per_node!r}")
        if not (isinstance(self.gpu_memory_gb, (int, float)) and self.gpu_memory_gb > 0):
            raise ValueError(f"GPU memory must be a positive number of GB, got {self.gpu_memory_gb!r}")
