"""Layout planner: an analytic cost model that predicts step time and memory per GPU for every valid
layout of a multimodal workload, colocated, non-colocated and Megatron's homogeneous baseline.

Pure Python (no torch): `tools/plan_layout.py` is its command line. Every figure is a prediction
from formulas and a calibration; the assumptions are stated where they are used.

The model, per training step:
- compute: FLOPs per module from its weights (2 FLOPs per weight per token forward) plus attention
  (4 x attended keys x hidden per token), backward = 2 x forward, a frozen module runs forward only;
  divided over the GPUs that share the work and run at `matmul_tflops x efficiency`, where the
  efficiency drops as TP narrows each GPU's GEMMs (or comes from a measured per-layer time);
- communication: TP (2 all-reduces per layer forward, 2 backward, or the equal-cost all-gather +
  reduce-scatter pairs of sequence parallelism), CP (the K/V all-gather of each layer forward, a
  reduce-scatter of dK/dV backward), the DP gradient all-reduce over DP x CP (not overlapped, as the
  trainer runs it), pipeline sends, the boundary (encoder rows to the LLM, gradients back); nothing
  overlaps with compute;
- schedule: colocated LLM pp=1 runs encoder forward, LLM forward/backward and encoder backward per
  microbatch; colocated LLM pp>1 adds the LLM's 1F1B bubble and one recomputed encoder forward;
  non-colocated is one 1F1B pipeline of encoder stages then LLM stages, whose slowest stage sets the
  pace; the homogeneous baseline puts the encoders, with the LLM's TP (replicated over its CP), on
  the LLM's first pipeline stage;
- memory per GPU: fp32 weights, fp32 gradients and fp32 Adam moments (16 bytes per trainable
  parameter; the distributed optimizer shards the 8 Adam bytes over DP x CP; a frozen module keeps
  its 4-byte weights only), plus activations without recomputation for the microbatches 1F1B keeps
  in flight.

Calibration JSON (what bench_e2e.py writes; every key is optional, a missing one takes the default
of `Calibration`, an assumption):

    {
      "source": "free text: what was measured, where, when",
      "matmul_tflops": 790,              dense bf16 GEMM throughput one GPU reaches (TFLOPS)
      "max_efficiency": 0.30,            fraction of matmul_tflops a transformer layer reaches at
                                         wide GEMMs (hidden / tp >> half_efficiency_width)
      "half_efficiency_width": 256,      per-GPU GEMM width (hidden / tp) at which that halves
      "layer_forward_us_per_token": {    measured: microseconds one GPU of a TP group spends per
        "vision": {"1": 0.9, "2": 0.6},  token on one layer's forward, TP (and CP) communication
        "llm": {"2": 5.1, "tp1cp2": 3.0} included, keyed by module name then TP size ("2") or TP
      },                                 and CP sizes ("tp1cp2"); replaces the FLOP model of the
                                         layers for that module and layout (backward = 2 x
                                         forward); tools/check_planner.py fits it to bench_e2e runs
      "nvlink_gbps": 350,                collective bus bandwidth inside a node (GB/s)
      "p2p_gbps": 265,                   point-to-point bandwidth inside a node, per direction
      "network_gbps": 40,                per-GPU bandwidth between nodes (collectives and sends)
      "collective_latency_us": 15,       fixed cost of one collective or send
      "boundary_gbps": 200,              colocated boundary re-layout throughput per GPU
      "boundary_call_ms": 0.4,           fixed cost of one boundary exchange (one direction)
      "usable_memory_fraction": 0.9,     share of GPU memory the model may fill
      "activation_memory_factor": 1.0,   measured activation bytes / the formula's (what it leaves
                                         out: autocast's bf16 weight copies, allocator rounding)
      "notes": {"key": "measured / assumed, and from what"}
    }
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from itertools import product

from megatron_hetero.layout import AXES, Edge, HeteroLayout, ModuleLayout

__all__ = [
    "PRESETS",
    "Calibration",
    "Candidate",
    "Cluster",
    "CostModel",
    "ModuleShape",
    "Plan",
    "Prediction",
    "Preset",
    "Seconds",
    "Workload",
    "best_micro_batch",
    "candidate_from_layout",
    "enumerate_candidates",
    "explain",
    "layout_problem",
    "layout_yaml",
    "model_flops_per_step",
    "module_params",
    "module_forward_flops_per_sample",
    "plan",
]

PLACEMENTS = ("colocated", "non_colocated", "homogeneous")
GB = 1e9

# Bytes per parameter kept on a GPU (the trainer: fp32 weights under bf16 autocast, fp32 gradients
# reduced in fp32, fp32 AdamW moments).
WEIGHT_BYTES = 4
GRADIENT_BYTES = 4
ADAM_BYTES = 8
LOGIT_BYTES = 4  # the loss reads fp32 logits


def _load_json(path: str, what: str, build):
    """build(the JSON document at path); every failure a one-line ValueError starting with path."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: line {exc.lineno}: {exc.msg}") from None
    try:
        return build(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class ModuleShape:
    """A module's size and its work per sample.

    Encoders: `tokens_per_item` tokens run through the encoder per image or clip, `items_per_sample`
    items per sample, `output_tokens_per_item` rows per item enter the LLM (fewer than the tokens
    with pixel shuffle; 0: as many), through an MLP projector of hidden width `projector_ffn` (0: a
    linear projection). The LLM: `seq_length` tokens per sample, `vocab` output classes."""

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
    seq_length: int = 0
    vocab: int = 0
    frozen: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"module name must be a non-empty string, got {self.name!r}")
        where = f"module {self.name}"
        for key in ("gated_mlp", "frozen"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{where}: {key} must be true or false, got {getattr(self, key)!r}")
        if self.role not in ("encoder", "llm"):
            raise ValueError(f"{where}: role {self.role!r} is not valid; use encoder or llm")
        for key in ("hidden", "layers", "heads", "ffn"):
            if not _positive_int(getattr(self, key)):
                raise ValueError(f"{where}: {key} must be a positive integer, got {getattr(self, key)!r}")
        for key in ("kv_heads", "tokens_per_item", "items_per_sample", "output_tokens_per_item",
                    "projector_ffn", "seq_length", "vocab"):
            value = getattr(self, key)
            if not (_positive_int(value) or value == 0):
                raise ValueError(f"{where}: {key} must be a non-negative integer, got {value!r}")
        if self.hidden % self.heads:
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
        return self.kv_groups * self.hidden // self.heads

    @property
    def rows_per_item(self) -> int:
        """Encoder rows one item sends into the LLM sequence."""
        return self.output_tokens_per_item or self.tokens_per_item

    @property
    def tokens_per_sample(self) -> int:
        """Tokens the module's layers run per sample."""
        return self.seq_length if self.role == "llm" else self.items_per_sample * self.tokens_per_item

    @property
    def rows_per_sample(self) -> int:
        return self.items_per_sample * self.rows_per_item


@dataclass(frozen=True)
class Workload:
    encoders: tuple[ModuleShape, ...]
    llm: ModuleShape
    global_batch: int
    micro_batch: int = 0  # samples per LLM DP rank per microbatch; 0: the planner picks
    dtype_bytes: int = 2  # activations and boundary rows (bf16)
    distributed_optimizer: bool = False
    # Candidates may also use megatron-core's full activation recomputation
    # (recompute_granularity="full"): a layer keeps only its input and reruns its forward in the
    # backward. Megatron (the homogeneous baseline) can; the trainer does not yet.
    allow_recompute: bool = False

    def __post_init__(self):
        object.__setattr__(self, "encoders", tuple(self.encoders))
        if self.llm.role != "llm":
            raise ValueError(f"module {self.llm.name}: the workload's llm must have role llm")
        names = [self.llm.name]
        for encoder in self.encoders:
            if encoder.role != "encoder":
                raise ValueError(f"module {encoder.name}: listed as an encoder but its role is {encoder.role}")
            if encoder.name in names:
                raise ValueError(f"module {encoder.name}: named twice; give each module its own name")
            names.append(encoder.name)
        if not _positive_int(self.global_batch):
            raise ValueError(f"global batch must be a positive integer, got {self.global_batch!r}")
        if not (_positive_int(self.micro_batch) or self.micro_batch == 0):
            raise ValueError(f"micro batch must be a positive integer (or 0: let the planner pick), got {self.micro_batch!r}")
        for key in ("distributed_optimizer", "allow_recompute"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false, got {getattr(self, key)!r}")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"dtype bytes must be 2 (bf16) or 4 (fp32), got {self.dtype_bytes!r}")
        rows = sum(e.rows_per_sample for e in self.encoders)
        if rows >= self.llm.seq_length:
            raise ValueError(f"{rows} encoder rows per sample do not fit the llm's seq_length "
                             f"{self.llm.seq_length} with any text; raise seq_length or lower items_per_sample")

    @property
    def modules(self) -> tuple[ModuleShape, ...]:
        return (*self.encoders, self.llm)

    @classmethod
    def from_dict(cls, data: dict) -> Workload:
        """{"encoders": [{ModuleShape fields but role}, ...], "llm": {...}, "global_batch": N, and
        optionally micro_batch, dtype_bytes, distributed_optimizer, allow_recompute}."""
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
        return _load_json(path, "workload", cls.from_dict)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_gb: float
    gpus_per_node: int = 8  # ranks are numbered node by node

    def __post_init__(self):
        if not _positive_int(self.gpus):
            raise ValueError(f"gpus must be a positive integer, got {self.gpus!r}")
        if not _positive_int(self.gpus_per_node):
            raise ValueError(f"gpus per node must be a positive integer, got {self.gpus_per_node!r}")
        if not (isinstance(self.gpu_memory_gb, (int, float)) and self.gpu_memory_gb > 0):
            raise ValueError(f"GPU memory must be a positive number of GB, got {self.gpu_memory_gb!r}")


def _tp_cp(key) -> tuple[int, int] | None:
    """A measured layer time's layout key: "2" (TP 2) or "tp1cp2" as (tp, cp); None if neither."""
    if isinstance(key, tuple):  # already parsed (a Calibration copied with dataclasses.replace)
        return key if len(key) == 2 and all(_positive_int(n) for n in key) else None
    text = str(key)
    if text.isdigit() and int(text) > 0:
        return int(text), 1
    if text.startswith("tp") and "cp" in text:
        tp, cp = text[2:].split("cp", 1)
        if tp.isdigit() and cp.isdigit() and int(tp) > 0 and int(cp) > 0:
            return int(tp), int(cp)
    return None


@dataclass(frozen=True)
class Calibration:
    """Hardware figures; the defaults are assumptions for one H200 node (see
    tools/calibration_h200.json for where each comes from)."""

    matmul_tflops: float = 790.0
    max_efficiency: float = 0.30
    half_efficiency_width: float = 256.0
    layer_forward_us_per_token: dict = field(default_factory=dict)  # {module name: {(tp, cp): us}}
    nvlink_gbps: float = 350.0
    p2p_gbps: float = 265.0
    network_gbps: float = 40.0
    collective_latency_us: float = 15.0
    boundary_gbps: float = 200.0
    boundary_call_ms: float = 0.4
    usable_memory_fraction: float = 0.9
    activation_memory_factor: float = 1.0
    source: str = "assumed defaults"

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "source" and not isinstance(value, str):
                raise ValueError(f"calibration: source must be a string, got {value!r}")
            if f.name in ("source", "layer_forward_us_per_token"):
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"calibration: {f.name} must be a non-negative number, got {value!r}")
        for key in ("matmul_tflops", "max_efficiency", "nvlink_gbps", "p2p_gbps", "network_gbps",
                    "boundary_gbps", "usable_memory_fraction", "activation_memory_factor"):
            if getattr(self, key) <= 0:
                raise ValueError(f"calibration: {key} must be positive, got {getattr(self, key)!r}")
        if self.max_efficiency > 1 or self.usable_memory_fraction > 1:
            raise ValueError("calibration: max_efficiency and usable_memory_fraction are fractions of at most 1")
        measured = {}
        if not isinstance(self.layer_forward_us_per_token, dict):
            raise ValueError("calibration: layer_forward_us_per_token must map module names to {tp: microseconds}")
        for name, by_tp in self.layer_forward_us_per_token.items():
            if not isinstance(by_tp, dict):
                raise ValueError(f"calibration: layer_forward_us_per_token.{name} must map TP sizes to microseconds")
            measured[name] = {}
            for key, us in by_tp.items():
                axes = _tp_cp(key)
                if axes is None or not (isinstance(us, (int, float)) and us > 0):
                    raise ValueError(f"calibration: layer_forward_us_per_token.{name}: {key!r}: {us!r} is not "
                                     f"a TP size (\"2\") or TP and CP sizes (\"tp1cp2\") and a positive time "
                                     f"in microseconds")
                measured[name][axes] = float(us)
        object.__setattr__(self, "layer_forward_us_per_token", measured)

    def to_dict(self) -> dict:
        """The JSON form that from_dict reads."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["layer_forward_us_per_token"] = {
            name: {str(tp) if cp == 1 else f"tp{tp}cp{cp}": us for (tp, cp), us in by_axes.items()}
            for name, by_axes in self.layer_forward_us_per_token.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        if not isinstance(data, dict):
            raise ValueError(f"calibration must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known | {"notes"}:
                raise ValueError(f"calibration: unknown key {key!r}; known keys: {', '.join(sorted(known | {'notes'}))}")
        return cls(**{k: v for k, v in data.items() if k != "notes"})

    @classmethod
    def load(cls, path: str) -> Calibration:
        return _load_json(path, "calibration", cls.from_dict)


# ---------------------------------------------------------------------------------------------
# FLOPs and parameters (standard dense-transformer counts)


def layer_params(shape: ModuleShape) -> int:
    """Weights of one transformer layer: Q and output projections (hidden^2 each), K and V
    (hidden x kv_dim each), the MLP (2 or, gated, 3 hidden x ffn matrices). Biases and norms are
    left out (well under 1%)."""
    attention = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * shape.kv_dim
    mlp = (3 if shape.gated_mlp else 2) * shape.hidden * shape.ffn
    return attention + mlp


def head_params(shape: ModuleShape, llm_hidden: int) -> int:
    """Weights outside the layers: the LLM's input embedding and output layer (untied); an
    encoder's projector into the LLM hidden size, whose input is the concatenation of the tokens
    pixel shuffle merges into one row. The patch embedding is left out."""
    if shape.role == "llm":
        return 2 * shape.vocab * shape.hidden
    width_in = shape.hidden * (shape.tokens_per_item // shape.rows_per_item)
    if shape.projector_ffn:
        return width_in * shape.projector_ffn + shape.projector_ffn * llm_hidden
    return width_in * llm_hidden


def module_params(shape: ModuleShape, llm_hidden: int) -> int:
    return shape.layers * layer_params(shape) + head_params(shape, llm_hidden)


def attended_tokens(shape: ModuleShape) -> float:
    """Keys one query attends to on average: its whole item for an encoder (bidirectional), half
    the sequence for the causal LLM (assumes the attention kernel skips fully masked blocks, as
    flash attention and SDPA's causal path do)."""
    return shape.tokens_per_item if shape.role == "encoder" else shape.seq_length / 2


def layer_forward_flops_per_token(shape: ModuleShape) -> float:
    """2 FLOPs (one multiply-add) per weight, plus attention: Q K^T and the weighted sum of V, each
    2 x attended keys x hidden."""
    return 2 * layer_params(shape) + 4 * attended_tokens(shape) * shape.hidden


def head_forward_flops_per_sample(shape: ModuleShape, llm_hidden: int) -> float:
    """The LLM's output layer on every position (the input embedding is a lookup); an encoder's
    projector on every row it sends."""
    if shape.role == "llm":
        return 2 * shape.vocab * shape.hidden * shape.seq_length
    return 2 * head_params(shape, llm_hidden) * shape.rows_per_sample


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


# ---------------------------------------------------------------------------------------------
# Memory


def activation_bytes_per_token_layer(shape: ModuleShape, tp: int, sp: bool, dtype_bytes: int) -> float:
    """Activations one layer keeps per token for its backward, on one GPU, without recomputation
    (Korthikanti et al. 2022, "Reducing Activation Recomputation", with dropout off and a fused
    attention kernel that keeps no seq x seq scores):
    - the two norm inputs and the two norm outputs that feed the QKV and FC1 GEMMs (4 x hidden),
      whole on every TP rank unless sequence parallelism splits them;
    - Q, K, V, the attention output, the FC1 output(s) and the activation output, split by TP."""
    replicated = 4 * shape.hidden
    split = 2 * shape.hidden + 2 * shape.kv_dim + (3 if shape.gated_mlp else 2) * shape.ffn
    return dtype_bytes * ((replicated / tp if sp else replicated) + split / tp)


# ---------------------------------------------------------------------------------------------
# Candidates and predictions


@dataclass(frozen=True)
class Candidate:
    """One way to run the workload: a placement, one layout per module (encoders in workload
    order, the llm last), the micro batch size and whether trainable modules recompute their
    activations. `homogeneous` is Megatron today: every encoder takes the LLM's tp, cp and dp (an
    encoder does not split an image over CP: it runs replicated on the CP ranks) and sits on the
    LLM's first pipeline stage."""

    placement: str
    layouts: tuple[ModuleLayout, ...]
    micro_batch: int
    recompute: bool = False

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r} is not valid; use one of {', '.join(PLACEMENTS)}")

    @property
    def llm(self) -> ModuleLayout:
        return self.layouts[-1]

    @property
    def encoders(self) -> tuple[ModuleLayout, ...]:
        return self.layouts[:-1]

    @property
    def runnable(self) -> bool:
        """Whether megatron-hetero's trainer runs it as a layout file: the homogeneous baseline only
        when it has no CP and no PP (then it is the colocated layout with equal TP and DP)."""
        return self.placement != "homogeneous" or (self.llm.cp == 1 and self.llm.pp == 1)

    def describe(self) -> str:
        parts = []
        for layout in self.layouts:
            sizes = " ".join(f"{axis}{getattr(layout, axis)}" for axis in AXES if getattr(layout, axis) > 1)
            flags = "".join([" sp" if layout.sp else "", " frozen" if layout.freeze else ""])
            where = f" @{layout.ranks.start}-{layout.ranks.stop - 1}" if self.placement == "non_colocated" else ""
            parts.append(f"{layout.name} {sizes or 'x1'}{flags}{where}")
        return " | ".join(parts) + (" (recompute)" if self.recompute else "")

    def hetero_layout(self, world_size: int) -> HeteroLayout:
        """The layout file's content (validated by megatron_hetero.layout)."""
        if not self.runnable:
            raise ValueError(f"{self.describe()}: the homogeneous baseline with CP or PP is not a layout "
                             f"megatron-hetero runs; pick a colocated or non-colocated candidate")
        placement = "colocated" if self.placement == "homogeneous" else self.placement
        modules = self.layouts
        if placement == "colocated":  # the encoders span every rank
            modules = tuple(replace(m, first_rank=0) for m in self.layouts)
        edges = tuple(Edge(e.name, self.llm.name) for e in self.encoders)
        return HeteroLayout(placement=placement, world_size=world_size, modules=modules, edges=edges)


@dataclass(frozen=True)
class Seconds:
    """Time one GPU spends, by component."""

    compute: float = 0.0
    tp_comm: float = 0.0
    cp_comm: float = 0.0
    p2p: float = 0.0  # pipeline sends between stages
    boundary: float = 0.0  # encoder rows to the LLM and their gradients back
    dp_sync: float = 0.0  # gradient all-reduce over DP x CP

    def __add__(self, other: Seconds) -> Seconds:
        return Seconds(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __mul__(self, k: float) -> Seconds:
        return Seconds(*(getattr(self, f.name) * k for f in fields(self)))

    __rmul__ = __mul__

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    step_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    memory_gb: float
    fits: bool
    busy: dict  # module name -> Seconds: what the critical GPU does per step
    idle_s: float  # what the critical GPU waits per step: pipeline bubble, stage imbalance
    stage_s: dict  # module name -> seconds of one pipeline stage per microbatch (forward + backward)
    reason: str = ""


class CostModel:
    """Predictions for one workload on one cluster with one calibration."""

    def __init__(self, workload: Workload, cluster: Cluster, calibration: Calibration):
        self.workload, self.cluster, self.calibration = workload, cluster, calibration
        self.shapes = {shape.name: shape for shape in workload.modules}
        self._passes = {}

    # -- links and collectives ---------------------------------------------------------------

    def _gbps(self, size: int, stride: int, inside_node: float) -> float:
        """Bandwidth of a group of `size` ranks `stride` apart: the node's links when the group fits
        in one node, else the network (assumption: ranks are numbered node by node, and a group that
        crosses nodes runs at the network's per-GPU bandwidth)."""
        return inside_node if size * stride <= self.cluster.gpus_per_node else self.calibration.network_gbps

    def _latency(self) -> float:
        return self.calibration.collective_latency_us * 1e-6

    def all_reduce_s(self, nbytes: float, size: int, stride: int) -> float:
        """Ring all-reduce: each GPU moves 2 (size-1)/size of the buffer at the bus bandwidth."""
        if size == 1:
            return 0.0
        gbps = self._gbps(size, stride, self.calibration.nvlink_gbps)
        return self._latency() + 2 * (size - 1) / size * nbytes / (gbps * GB)

    def all_gather_s(self, out_bytes: float, size: int, stride: int) -> float:
        """All-gather (or reduce-scatter) of an `out_bytes` result: (size-1)/size of it moves."""
        if size == 1:
            return 0.0
        gbps = self._gbps(size, stride, self.calibration.nvlink_gbps)
        return self._latency() + (size - 1) / size * out_bytes / (gbps * GB)

    def send_s(self, nbytes: float, distance: int) -> float:
        """One point-to-point send to a rank `distance` away."""
        gbps = self._gbps(2, distance, self.calibration.p2p_gbps)
        return self._latency() + nbytes / (gbps * GB)

    # -- one microbatch through one module -------------------------------------------------------

    def efficiency(self, shape: ModuleShape, tp: int) -> float:
        """Fraction of matmul_tflops a layer reaches: max_efficiency x w / (w + half width), w =
        hidden / tp the GEMM width one GPU gets. Assumption: TP narrows every GEMM of the layer and a
        narrower GEMM (with as many kernel launches) runs further below peak; the token dimension is
        taken as long enough not to matter."""
        width = shape.hidden / tp
        cal = self.calibration
        return cal.max_efficiency * width / (width + cal.half_efficiency_width)

    def measured_layer_us(self, shape: ModuleShape, tp: int, cp: int = 1) -> float | None:
        return self.calibration.layer_forward_us_per_token.get(shape.name, {}).get((tp, cp))

    def layer_forward(self, shape: ModuleShape, tp: int, tokens: float) -> Seconds:
        """One layer's forward over `tokens` tokens on one GPU of a TP group: compute and the two TP
        collectives (all-reduces; with sequence parallelism an all-gather and a reduce-scatter, the
        same bytes). A measured time per token, where the calibration has one, replaces both."""
        measured = self.measured_layer_us(shape, tp)
        if measured is not None:
            return Seconds(compute=measured * 1e-6 * tokens)
        flops = tokens * layer_forward_flops_per_token(shape) / tp
        compute = flops / (self.calibration.matmul_tflops * 1e12 * self.efficiency(shape, tp))
        nbytes = tokens * shape.hidden * self.workload.dtype_bytes
        return Seconds(compute=compute, tp_comm=2 * self.all_reduce_s(nbytes, tp, 1))

    def microbatch_pass(self, shape: ModuleShape, layout: ModuleLayout, samples: float,
                        recompute: bool) -> tuple[Seconds, Seconds]:
        """(forward, backward) of `samples` samples through the whole module (all its layers; a
        pipeline stage does 1/pp of it) on one GPU of one DP replica. The LLM splits each sequence
        over CP; an encoder never does (its layout's cp, in the homogeneous baseline, replicates
        it). Backward: 2 x the forward FLOPs (input and weight gradients) and the same collectives
        in reverse (TP: two per layer; CP: a reduce-scatter of dK and dV); with recomputation, the
        layers' forward once more."""
        key = (shape.name, layout.tp, layout.cp, samples, recompute)
        if key not in self._passes:
            splits_sequence = shape.role == "llm"
            cp = layout.cp if splits_sequence else 1
            tokens = samples * shape.tokens_per_sample / cp
            measured = self.measured_layer_us(shape, layout.tp, cp) if cp > 1 else None
            if measured is not None:  # CP's K/V exchange included
                layer, cp_comm = Seconds(compute=measured * 1e-6 * tokens), 0.0
            else:
                layer = self.layer_forward(shape, layout.tp, tokens)
                kv_bytes = cp * tokens * 2 * shape.kv_dim / layout.tp * self.workload.dtype_bytes
                cp_comm = self.all_gather_s(kv_bytes, cp, layout.tp)
            head_flops = samples * head_forward_flops_per_sample(shape, self.workload.llm.hidden) / (layout.tp * cp)
            head = head_flops / (self.calibration.matmul_tflops * 1e12 * self.efficiency(shape, layout.tp))
            forward = shape.layers * (layer + Seconds(cp_comm=cp_comm)) + Seconds(compute=head)
            backward = Seconds(compute=2 * forward.compute, tp_comm=forward.tp_comm, cp_comm=forward.cp_comm)
            if recompute and not shape.frozen:
                backward += shape.layers * (layer + Seconds(cp_comm=cp_comm))
            self._passes[key] = (forward, backward)
        return self._passes[key]

    def stage_pass(self, shape: ModuleShape, layout: ModuleLayout, samples: float,
                   recompute: bool) -> tuple[Seconds, Seconds]:
        """(forward, backward) of one pipeline stage for one microbatch: 1/pp of the module (the
        embedding and output layer spread evenly, as if balanced) plus, with pp > 1, the send of
        its activations (its gradients backward) to the neighbouring stage."""
        forward, backward = self.microbatch_pass(shape, layout, samples, recompute)
        if layout.pp == 1:
            return forward, backward
        tokens = samples * shape.tokens_per_sample / (layout.cp if shape.role == "llm" else 1)
        nbytes = tokens * shape.hidden * self.workload.dtype_bytes / (layout.tp if layout.sp else 1)
        send = Seconds(p2p=self.send_s(nbytes, layout.tp * layout.cp * layout.dp))
        return forward * (1 / layout.pp) + send, backward * (1 / layout.pp) + send

    def dp_sync_s(self, shape: ModuleShape, layout: ModuleLayout) -> float:
        """The fp32 gradient all-reduce of a trainable module over its DP x CP group, once per step
        (reduce-scatter + all-gather with the distributed optimizer: the same bytes)."""
        if shape.frozen:
            return 0.0
        params = self.stage_params(shape, layout)
        return self.all_reduce_s(params * GRADIENT_BYTES, layout.dp * layout.cp, layout.tp)

    # -- memory ---------------------------------------------------------------------------------

    def stage_params(self, shape: ModuleShape, layout: ModuleLayout) -> float:
        """Parameters on one GPU of the module's heaviest stage: its layers, plus the embedding and
        output layer (both with pp=1, one of them on the first or last stage), or the projector."""
        head = head_params(shape, self.workload.llm.hidden)
        if shape.role == "llm" and layout.pp > 1:
            head /= 2
        return (shape.layers // layout.pp * layer_params(shape) + head) / layout.tp

    def static_bytes(self, shape: ModuleShape, layout: ModuleLayout) -> float:
        """Weights, gradients and optimizer state on one GPU (the distributed optimizer shards the
        Adam moments over DP x CP; a frozen module keeps its weights only)."""
        params = self.stage_params(shape, layout)
        if shape.frozen:
            return params * WEIGHT_BYTES
        shards = layout.dp * layout.cp if self.workload.distributed_optimizer else 1
        return params * (WEIGHT_BYTES + GRADIENT_BYTES + ADAM_BYTES / shards)

    def activation_bytes(self, shape: ModuleShape, layout: ModuleLayout, samples: float, recompute: bool) -> float:
        """Activations one microbatch leaves on one GPU of a stage for its backward (none for a
        frozen module, which runs without a graph); with recomputation, each layer's input plus one
        layer's full activations while it runs backward. The LLM adds its fp32 logits (counted on
        every stage: conservative for the first)."""
        if shape.frozen:
            return 0.0
        cp = layout.cp if shape.role == "llm" else 1
        tokens = samples * shape.tokens_per_sample / cp
        dtype = self.workload.dtype_bytes
        per_token = activation_bytes_per_token_layer(shape, layout.tp, layout.sp, dtype)
        layers = shape.layers / layout.pp
        if recompute:
            layer_input = shape.hidden * dtype / (layout.tp if layout.sp else 1)
            total = tokens * (layers * layer_input + per_token)
        else:
            total = tokens * per_token * layers
        if shape.role == "llm":
            total += tokens * shape.vocab / layout.tp * LOGIT_BYTES
        return total * self.calibration.activation_memory_factor

    def rows_bytes(self, samples: float) -> float:
        """Boundary rows of `samples` samples: every encoder's rows at the LLM hidden size."""
        rows = samples * sum(e.rows_per_sample for e in self.workload.encoders)
        return rows * self.workload.llm.hidden * self.workload.dtype_bytes

    # -- boundary ---------------------------------------------------------------------------------

    def _boundary_s(self, nbytes: float, gbps: float, trainable: bool) -> float:
        calls = 2 if trainable else 1  # rows forward; gradients back for a trainable encoder
        return calls * (self.calibration.boundary_call_ms * 1e-3 + nbytes / (gbps * GB))

    def colocated_boundary_s(self, shape: ModuleShape, candidate: Candidate) -> float:
        """One microbatch's re-layout of one encoder's rows on one GPU: its share of the rows
        arrives (the planned minimum: with sequence parallelism each row reaches one LLM rank of the
        first stage; without it, the TP replicas), at the measured re-layout throughput. Inside a
        node unless LLM pp > 1 gathers every GPU's rows onto the first stage across nodes."""
        llm = candidate.llm
        stage_ranks = llm.tp * llm.cp * llm.dp
        replicas = 1 if llm.sp else llm.tp
        nbytes = self.rows_bytes(candidate.micro_batch * llm.dp) * replicas / stage_ranks
        nbytes *= shape.rows_per_sample / sum(e.rows_per_sample for e in self.workload.encoders)
        crosses_nodes = llm.pp > 1 and self.cluster.gpus > self.cluster.gpus_per_node
        gbps = self.calibration.network_gbps if crosses_nodes else self.calibration.boundary_gbps
        return self._boundary_s(nbytes, gbps, not shape.frozen)

    def non_colocated_boundary_s(self, shape: ModuleShape, layout: ModuleLayout, candidate: Candidate) -> float:
        """One microbatch's rows from an encoder's last stage to the LLM's first, point to point;
        the busier end (the encoder GPUs sending, spread over its TP ranks, or the LLM GPUs
        receiving) sets the time. Ranks of another module are taken as one node away unless the
        whole cluster is one node."""
        llm = candidate.llm
        rows = self.rows_bytes(candidate.micro_batch * llm.dp)
        rows *= shape.rows_per_sample / sum(e.rows_per_sample for e in self.workload.encoders)
        nbytes = max(rows / (layout.dp * layout.tp), rows / (llm.tp * llm.cp * llm.dp))
        one_node = self.cluster.gpus <= self.cluster.gpus_per_node
        gbps = self.calibration.p2p_gbps if one_node else self.calibration.network_gbps
        return self._boundary_s(nbytes, gbps, not shape.frozen)

    # -- placements ---------------------------------------------------------------------------------

    def microbatches(self, candidate: Candidate) -> int:
        return self.workload.global_batch // (candidate.micro_batch * candidate.llm.dp)

    def encoder_samples(self, candidate: Candidate, layout: ModuleLayout) -> float:
        """Samples one encoder DP replica runs per microbatch: the microbatch of every LLM DP rank
        (micro batch x llm dp samples) split over the encoder's DP ranks; in the homogeneous
        baseline, the micro batch of its own LLM DP replica."""
        if candidate.placement == "homogeneous":
            return candidate.micro_batch
        return candidate.micro_batch * candidate.llm.dp / layout.dp

    def predict(self, candidate: Candidate) -> Prediction:
        step = {"colocated": self._colocated, "non_colocated": self._non_colocated,
                "homogeneous": self._homogeneous}[candidate.placement]
        busy, idle, stage_s, memory = step(candidate)
        step_s = sum(s.total for s in busy.values()) + idle
        workload = self.workload
        capacity = self.cluster.gpu_memory_gb * self.calibration.usable_memory_fraction
        return Prediction(
            candidate=candidate,
            step_s=step_s,
            tokens_per_s=workload.global_batch * workload.llm.seq_length / step_s,
            tflops_per_gpu=model_flops_per_step(workload) / step_s / self.cluster.gpus / 1e12,
            memory_gb=memory / GB,
            fits=memory / GB <= capacity,
            busy=busy,
            idle_s=idle,
            stage_s=stage_s,
        )

    def _encoder_step(self, candidate: Candidate, rerun_forward: bool) -> tuple[dict, float, float]:
        """Encoders on every GPU of theirs over a step: (busy by module, static bytes, activation
        bytes of one microbatch). A trainable encoder runs forward and backward per microbatch, and
        its forward once more when the colocated LLM is pipelined (the schedule reruns it with its
        graph after the LLM pipeline)."""
        m = self.microbatches(candidate)
        busy, static, activations = {}, 0.0, 0.0
        for layout in candidate.encoders:
            shape = self.shapes[layout.name]
            samples = self.encoder_samples(candidate, layout)
            forward, backward = self.microbatch_pass(shape, layout, samples, candidate.recompute)
            per_microbatch = forward if shape.frozen else forward * (2 if rerun_forward else 1) + backward
            if candidate.placement == "colocated":
                per_microbatch += Seconds(boundary=self.colocated_boundary_s(shape, candidate))
            busy[layout.name] = m * per_microbatch + Seconds(dp_sync=self.dp_sync_s(shape, layout))
            static += self.static_bytes(shape, layout)
            activations += self.activation_bytes(shape, layout, samples, candidate.recompute)
        return busy, static, activations

    def _colocated(self, candidate: Candidate):
        llm_shape, llm = self.workload.llm, candidate.llm
        m = self.microbatches(candidate)
        busy, static, encoder_activations = self._encoder_step(candidate, rerun_forward=llm.pp > 1)
        forward, backward = self.stage_pass(llm_shape, llm, candidate.micro_batch, candidate.recompute)
        stage = forward + backward
        busy[llm.name] = m * stage + Seconds(dp_sync=self.dp_sync_s(llm_shape, llm))
        idle = (llm.pp - 1) * stage.total  # the LLM's 1F1B fill and drain
        in_flight = min(llm.pp, m)
        llm_activations = in_flight * self.activation_bytes(llm_shape, llm, candidate.micro_batch, candidate.recompute)
        # With pp > 1 the encoders' rows for every microbatch wait for the LLM pipeline; the
        # encoders' activations exist only during their recompute, after it.
        rows = m * self.rows_bytes(candidate.micro_batch * llm.dp) / self.cluster.gpus if llm.pp > 1 else 0.0
        peak = rows + (max if llm.pp > 1 else sum)((encoder_activations, llm_activations))
        memory = static + self.static_bytes(llm_shape, llm) + peak
        return busy, idle, {llm.name: stage.total}, memory

    def _homogeneous(self, candidate: Candidate):
        llm_shape, llm = self.workload.llm, candidate.llm
        m = self.microbatches(candidate)
        busy, static, encoder_activations = self._encoder_step(candidate, rerun_forward=False)
        forward, backward = self.stage_pass(llm_shape, llm, candidate.micro_batch, candidate.recompute)
        stage = (forward + backward).total
        encoders = sum(s.total - s.dp_sync for s in busy.values()) / m
        # 1F1B with unequal stages: fill and drain through every stage, then the slowest stage
        # (the first, which also runs the encoders) paces the remaining m - 1 microbatches.
        stages = [stage + encoders] + [stage] * (llm.pp - 1)
        pipeline = sum(stages) + (m - 1) * max(stages)
        busy[llm.name] = m * (forward + backward) + Seconds(dp_sync=self.dp_sync_s(llm_shape, llm))
        idle = pipeline - m * stages[0]
        in_flight = min(llm.pp, m)
        memory = (static + self.static_bytes(llm_shape, llm)
                  + in_flight * (encoder_activations
                                 + self.activation_bytes(llm_shape, llm, candidate.micro_batch, candidate.recompute)))
        return busy, idle, {llm.name: stage, "first stage": stages[0]}, memory

    def _non_colocated(self, candidate: Candidate):
        llm_shape, llm = self.workload.llm, candidate.llm
        m, recompute = self.microbatches(candidate), candidate.recompute
        llm_forward, llm_backward = self.stage_pass(llm_shape, llm, candidate.micro_batch, recompute)
        llm_stage = llm_forward + llm_backward
        stage_s = {llm.name: llm_stage.total}
        memory = self.static_bytes(llm_shape, llm) + min(llm.pp, m) * self.activation_bytes(
            llm_shape, llm, candidate.micro_batch, recompute)
        encoder_depth, dp_sync = 0.0, self.dp_sync_s(llm_shape, llm)
        for layout in candidate.encoders:
            shape = self.shapes[layout.name]
            samples = self.encoder_samples(candidate, layout)
            forward, backward = self.stage_pass(shape, layout, samples, recompute)
            stage = (forward if shape.frozen else forward + backward).total
            # The boundary transfer belongs to the encoder's last stage (the LLM's first waits for it).
            last_stage = stage + self.non_colocated_boundary_s(shape, layout, candidate)
            stage_s[layout.name] = last_stage
            encoder_depth = max(encoder_depth, (layout.pp - 1) * stage + last_stage)
            dp_sync = max(dp_sync, self.dp_sync_s(shape, layout))
            # The first encoder stage keeps a microbatch in flight for every stage after it; a
            # frozen encoder runs ahead, its rows queued for the LLM.
            in_flight = min(layout.pp + llm.pp, m)
            queued = m * self.rows_bytes(candidate.micro_batch * llm.dp) / layout.size if shape.frozen else 0.0
            memory = max(memory, self.static_bytes(shape, layout) + queued
                         + in_flight * self.activation_bytes(shape, layout, samples, recompute))
        # One 1F1B pipeline: the encoder stages (branches in parallel) then the LLM's; the slowest
        # stage paces the remaining m - 1 microbatches. The critical GPU is an LLM GPU; DP syncs of
        # different modules run at once on their own GPUs.
        pipeline = encoder_depth + llm.pp * llm_stage.total + (m - 1) * max(stage_s.values())
        busy = {llm.name: m * llm_stage + Seconds(dp_sync=dp_sync)}
        idle = pipeline - m * llm_stage.total
        return busy, idle, stage_s, memory


# ---------------------------------------------------------------------------------------------
# Enumeration


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problem(shape: ModuleShape, layout: ModuleLayout, placement: str, cluster: Cluster) -> str | None:
    """Why megatron-core or the trainer would refuse this module layout, or None."""
    where = f"module {shape.name}"
    if layout.tp > cluster.gpus_per_node:
        return f"{where}: tp {layout.tp} spans more than a node's {cluster.gpus_per_node} GPUs"
    if shape.heads % layout.tp or shape.kv_groups % layout.tp:
        return f"{where}: {shape.heads} heads ({shape.kv_groups} key/value heads) do not split over tp {layout.tp}"
    if shape.layers % layout.pp:
        return f"{where}: {shape.layers} layers do not split over pp {layout.pp}"
    if shape.role == "encoder":
        # The homogeneous baseline's encoder "cp" is a replication (Megatron runs it on every CP rank).
        if layout.cp > 1 and placement != "homogeneous":
            return f"{where}: encoders run with cp 1 (an image is one sequence)"
        if layout.pp > 1 and placement != "non_colocated":
            return f"{where}: an encoder runs with pp 1 unless non-colocated"
        if layout.sp:
            return f"{where}: sequence parallelism is for the llm"
        return None
    if layout.cp > 1 and shape.seq_length % (2 * layout.cp):
        return f"{where}: seq_length {shape.seq_length} does not split into 2 x cp = {2 * layout.cp} chunks"
    if layout.sp and (shape.seq_length // layout.cp) % layout.tp:
        return f"{where}: seq_length {shape.seq_length} / cp {layout.cp} does not split into tp {layout.tp} parts"
    return None


def _factorizations(gpus: int, axes: tuple[str, ...]):
    """Every assignment of positive sizes to `axes` whose product is `gpus` (dp takes the rest)."""
    if not axes:
        yield {}
        return
    for size in _divisors(gpus):
        for rest in _factorizations(gpus // size, axes[1:]):
            yield {axes[0]: size, **rest}


def llm_layouts(shape: ModuleShape, gpus: int, first_rank: int, cluster: Cluster):
    """Every LLM layout on `gpus` GPUs that megatron-core and the trainer accept. Sequence
    parallelism is on whenever TP > 1 (it saves memory for the same communication)."""
    for sizes in _factorizations(gpus, ("tp", "cp", "pp")):
        dp = gpus // (sizes["tp"] * sizes["cp"] * sizes["pp"])
        layout = ModuleLayout(shape.name, "llm", dp=dp, sp=sizes["tp"] > 1, first_rank=first_rank, **sizes)
        if layout_problem(shape, layout, "colocated", cluster) is None:
            yield layout


def encoder_layouts(shape: ModuleShape, gpus: int, first_rank: int, cluster: Cluster, placement: str):
    """Every encoder layout on `gpus` GPUs the trainer runs in this placement."""
    for sizes in _factorizations(gpus, ("tp", "pp")):
        dp = gpus // (sizes["tp"] * sizes["pp"])
        layout = ModuleLayout(shape.name, "encoder", dp=dp, freeze=shape.frozen, first_rank=first_rank, **sizes)
        if layout_problem(shape, layout, placement, cluster) is None:
            yield layout


def homogeneous_encoder(shape: ModuleShape, llm: ModuleLayout, cluster: Cluster) -> ModuleLayout | None:
    """The encoder as Megatron runs it today: the LLM's tp, cp (replicated) and dp, on its first
    stage; None when it cannot (its heads do not split over that TP)."""
    layout = ModuleLayout(shape.name, "encoder", tp=llm.tp, cp=llm.cp, dp=llm.dp, freeze=shape.frozen)
    return None if layout_problem(shape, layout, "homogeneous", cluster) else layout


def micro_batches(workload: Workload, layouts: tuple[ModuleLayout, ...]) -> list[int]:
    """Micro batch sizes the trainer accepts for these layouts: micro batch x llm dp divides the
    global batch and splits evenly over every encoder's DP ranks."""
    llm_dp = layouts[-1].dp
    if workload.global_batch % llm_dp:
        return []
    sizes = [workload.micro_batch] if workload.micro_batch else _divisors(workload.global_batch // llm_dp)
    return [b for b in sizes
            if workload.global_batch % (b * llm_dp) == 0 and all(b * llm_dp % e.dp == 0 for e in layouts[:-1])]


def _variants(workload: Workload, placement: str, layouts: tuple[ModuleLayout, ...]) -> list[Candidate]:
    """The layouts with every valid micro batch size, with and (where allowed) without recomputation."""
    recompute = (False, True) if workload.allow_recompute else (False,)
    return [Candidate(placement, layouts, b, r) for b in micro_batches(workload, layouts) for r in recompute]


def is_homogeneous(encoders: tuple[ModuleLayout, ...], llm: ModuleLayout) -> bool:
    """Whether colocated module layouts are Megatron's homogeneous one (that the trainer can run):
    every encoder takes the LLM's TP and DP, and the LLM has no CP or PP."""
    return llm.cp == 1 and llm.pp == 1 and all(e.tp == llm.tp and e.dp == llm.dp for e in encoders)


def enumerate_candidates(workload: Workload, cluster: Cluster):
    """Yields, for every layout combination that passes the layout rules (colocated, homogeneous,
    non-colocated), its candidates: one per valid micro batch size (none: an empty list)."""
    gpus, encoders = cluster.gpus, workload.encoders
    for llm in llm_layouts(workload.llm, gpus, 0, cluster):
        homogeneous = tuple(homogeneous_encoder(e, llm, cluster) for e in encoders)
        if None not in homogeneous:
            layouts = (*homogeneous, llm)
            yield _variants(workload, "homogeneous", layouts)
        options = [list(encoder_layouts(e, gpus, 0, cluster, "colocated")) for e in encoders]
        for encoder_choice in product(*options):
            if is_homogeneous(encoder_choice, llm):
                continue  # listed above
            layouts = (*encoder_choice, llm)
            yield _variants(workload, "colocated", layouts)
    for split in product(range(1, gpus), repeat=len(encoders)):
        llm_gpus = gpus - sum(split)
        if llm_gpus < 1:
            continue
        starts = [sum(split[:i]) for i in range(len(split))]
        options = [list(encoder_layouts(e, n, start, cluster, "non_colocated"))
                   for e, n, start in zip(encoders, split, starts)]
        for llm in llm_layouts(workload.llm, llm_gpus, sum(split), cluster):
            for encoder_choice in product(*options):
                layouts = (*encoder_choice, llm)
                yield _variants(workload, "non_colocated", layouts)


@dataclass
class Plan:
    """One prediction per layout combination (its fastest micro batch size), fastest first: those
    that fit in memory, and those that do not (the fastest micro batch size of each)."""

    ranked: list[Prediction]
    over_memory: list[Prediction]

    def best(self, placement: str | None = None) -> Prediction | None:
        return next((p for p in self.ranked if placement in (None, p.candidate.placement)), None)


def best_micro_batch(model: CostModel, group: list[Candidate]) -> Prediction:
    """The fastest of a layout's micro batch sizes that fits in memory, else the one that comes
    closest to fitting."""
    predictions = [model.predict(c) for c in group]
    fitting = [p for p in predictions if p.fits]
    return min(fitting, key=lambda p: (p.step_s, p.memory_gb)) if fitting else min(predictions, key=lambda p: (p.memory_gb, p.step_s))


def plan(workload: Workload, cluster: Cluster, calibration: Calibration) -> Plan:
    """Predict every candidate, rank, and give every prediction its reason (against the best
    homogeneous layout that fits)."""
    model = CostModel(workload, cluster, calibration)
    predictions = [best_micro_batch(model, group) for group in enumerate_candidates(workload, cluster) if group]
    predictions.sort(key=lambda p: (p.step_s, p.memory_gb))
    fitting = [p for p in predictions if p.fits]
    reference = next((p for p in fitting if p.candidate.placement == "homogeneous"), None)
    capacity = cluster.gpu_memory_gb * calibration.usable_memory_fraction
    explained = [replace(p, reason=explain(p, reference, workload, capacity)) for p in predictions]
    return Plan([p for p in explained if p.fits], [p for p in explained if not p.fits])


def candidate_from_layout(layout: HeteroLayout, workload: Workload, cluster: Cluster) -> list[Candidate]:
    """A layout file as candidates, one per valid micro batch size and recomputation choice (a
    colocated file that is Megatron's homogeneous layout as that placement; ValueError when the
    workload's modules, the layout rules or the batch sizes do not fit it)."""
    if layout.world_size != cluster.gpus:
        raise ValueError(f"the layout is for {layout.world_size} ranks but the cluster has {cluster.gpus} GPUs")
    by_name = {m.name: m for m in layout.modules}
    expected = [shape.name for shape in workload.modules]
    if sorted(by_name) != sorted(expected):
        raise ValueError(f"layout modules {', '.join(sorted(by_name))} do not match the workload's "
                         f"{', '.join(expected)}")
    layouts = tuple(by_name[name] for name in expected)
    for shape, module in zip(workload.modules, layouts):
        problem = layout_problem(shape, module, layout.placement, cluster)
        if problem:
            raise ValueError(problem)
        if module.freeze != shape.frozen:
            raise ValueError(f"module {shape.name}: freeze: {str(module.freeze).lower()} in the layout, but the "
                             f"workload's {shape.name} is {'frozen' if shape.frozen else 'trained'}; make them agree")
    placement = layout.placement
    if placement == "colocated" and is_homogeneous(layouts[:-1], layouts[-1]):
        placement = "homogeneous"
    candidates = _variants(workload, placement, layouts)
    if not candidates:
        raise ValueError(f"no micro batch size splits global batch {workload.global_batch} over llm dp "
                         f"{layouts[-1].dp} and every encoder's dp")
    return candidates


# ---------------------------------------------------------------------------------------------
# Reasons


def _components(prediction: Prediction, workload: Workload) -> dict[str, float]:
    """Seconds per step of the critical GPU by what it does (encoders together)."""
    result = {"encoder compute": 0.0, "encoder TP comm": 0.0, "LLM compute": 0.0, "LLM TP comm": 0.0,
              "CP comm": 0.0, "pipeline sends": 0.0, "boundary": 0.0, "DP sync": 0.0,
              "pipeline wait": prediction.idle_s}
    for name, seconds in prediction.busy.items():
        who = "LLM" if name == workload.llm.name else "encoder"
        result[f"{who} compute"] += seconds.compute
        result[f"{who} TP comm"] += seconds.tp_comm
        result["CP comm"] += seconds.cp_comm
        result["pipeline sends"] += seconds.p2p
        result["boundary"] += seconds.boundary
        result["DP sync"] += seconds.dp_sync
    return result


def _axes(layout: ModuleLayout) -> str:
    sizes = [f"{axis.upper()}{getattr(layout, axis)}" for axis in AXES if getattr(layout, axis) > 1]
    return "/".join(sizes or ["TP1"]) + ("+SP" if layout.sp else "")


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def _versus(prediction: Prediction, reference: Prediction, workload: Workload) -> str:
    """The step time against the reference and the components that moved most: the two largest
    savings and the largest extra cost (each over 0.5% of the reference step)."""
    ours, theirs = _components(prediction, workload), _components(reference, workload)
    deltas = sorted((ours[k] - theirs[k], k) for k in ours)
    threshold = 0.005 * reference.step_s
    moved = [f"{k} {delta:+.2f} s" for delta, k in deltas[:2] if delta < -threshold]
    moved += [f"{k} {delta:+.2f} s" for delta, k in deltas[-1:] if delta > threshold]
    net = prediction.step_s - reference.step_s
    return f"vs best homogeneous {net:+.2f} s/step" + (f" ({', '.join(moved)})" if moved else "")


def explain(prediction: Prediction, reference: Prediction | None, workload: Workload, capacity_gb: float) -> str:
    """Why this layout ranks where it does: its encoders' and LLM's layouts, memory headroom, and
    what moved against the best homogeneous layout."""
    candidate = prediction.candidate
    llm = candidate.llm
    phrases = []
    if candidate.placement == "homogeneous":
        tp_phrase = f"TP{llm.tp}" + (f" replicated over CP{llm.cp}" if llm.cp > 1 else "")
        where = f" on the first of {llm.pp} LLM stages" if llm.pp > 1 else ""
        phrases.append(f"Megatron today: encoders at the LLM's {tp_phrase}{where}")
        if llm.pp > 1:
            phrases.append(f"first stage {prediction.stage_s['first stage']:.2f} s vs "
                           f"{prediction.stage_s[llm.name]:.2f} s per microbatch")
    for layout in candidate.encoders if candidate.placement != "homogeneous" else ():
        shape = next(e for e in workload.encoders if e.name == layout.name)
        notes = []
        if layout.tp < llm.tp:
            notes.append(f"not the LLM's TP{llm.tp}: no TP{llm.tp} all-reduces on its "
                         f"{shape.tokens_per_sample:,} tokens per sample")
        cap = candidate.micro_batch * llm.dp
        if layout.dp == cap and layout.size > layout.dp:
            notes.append(f"DP at the trainer's cap, micro batch x LLM DP = {cap}")
        text = f"{layout.name} at {_axes(layout)}" + (f" ({'; '.join(notes)})" if notes else "")
        if candidate.placement == "colocated":
            text += " on all GPUs"
        else:
            text += (f" on {_gpus(layout.size)}, {prediction.stage_s[layout.name]:.2f} s vs LLM "
                     f"{prediction.stage_s[llm.name]:.2f} s per microbatch")
        phrases.append(text)
    llm_text = f"LLM {_axes(llm)}"
    if llm.cp > 1:
        llm_text += f" (CP{llm.cp} splits the {workload.llm.seq_length // 1024}K sequence)"
    fits = "fits" if prediction.fits else "needs"
    phrases.append(f"{llm_text} {fits} {prediction.memory_gb:.0f} of {capacity_gb:.0f} GB")
    if prediction.idle_s > 0.005 * prediction.step_s:
        phrases.append(f"LLM GPUs wait {100 * prediction.idle_s / prediction.step_s:.0f}% of the step")
    if reference is not None and reference is not prediction:
        phrases.append(_versus(prediction, reference, workload))
    return "; ".join(phrases)


# ---------------------------------------------------------------------------------------------
# Layout file


def layout_yaml(prediction: Prediction, workload: Workload, cluster: Cluster) -> str:
    """A layout file for `python -m megatron_hetero.layout check FILE --world-size N` and the
    trainer's --hetero-layout, with the prediction and the batch flags in its header."""
    candidate = prediction.candidate
    layout = candidate.hetero_layout(cluster.gpus)
    lines = [
        f"# Written by tools/plan_layout.py for {cluster.gpus} GPUs, {candidate.placement}: {candidate.describe()}",
        f"# Predicted (from the calibration, not measured): {prediction.step_s:.2f} s/step, "
        f"{prediction.tokens_per_s:,.0f} tokens/s, {prediction.tflops_per_gpu:.0f} TFLOPS/GPU, "
        f"{prediction.memory_gb:.0f} GB/GPU",
        f"# Train with --global-batch-size {workload.global_batch} --micro-batch-size {candidate.micro_batch}"
        + (" --use-distributed-optimizer" if workload.distributed_optimizer else ""),
        *(["# The prediction assumes full activation recomputation, which the trainer does not do yet"]
          if candidate.recompute else []),
        f"placement: {layout.placement}",
        "modules:",
    ]
    for module in layout.modules:
        lines += [f"  {module.name}:", f"    role: {module.role}"]
        lines += [f"    {axis}: {getattr(module, axis)}" for axis in AXES]
        if module.sp:
            lines.append("    sp: true")
        if module.freeze:
            lines.append("    freeze: true")
        if layout.placement == "non_colocated":
            lines.append(f"    ranks: {module.ranks.start}-{module.ranks.stop - 1}")
    lines.append("edges:")
    lines += [f"  - {edge}" for edge in layout.edges]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Workload presets


@dataclass(frozen=True)
class Preset:
    workload: Workload
    description: str
    gpus: int


def _vit_so400m(frozen: bool) -> ModuleShape:
    """SigLIP-so400m shape: 729 patches per 384-px image, 16 images per sample; the projector is
    the trainer's MLP (hidden 4 x the LLM's)."""
    return ModuleShape("vision", "encoder", hidden=1152, layers=27, heads=16, ffn=4304,
                       tokens_per_item=729, items_per_sample=16, projector_ffn=4 * 4096, frozen=frozen)


def _llm_7b(seq_length: int) -> ModuleShape:
    """A 7B-class LLM as the trainer builds it (GPTModel, MLP 4 x hidden, no gating), with a 32K
    vocabulary."""
    return ModuleShape("llm", "llm", hidden=4096, layers=32, heads=32, ffn=4 * 4096,
                       seq_length=seq_length, vocab=32000)


PRESETS = {
    "W1": Preset(Workload((_vit_so400m(False),), _llm_7b(16384), global_batch=16),
                 "SigLIP-so400m ViT (16 images x 729 tokens per sample) into a 7B LLM at 16K, global batch 16", 2),
    "W2": Preset(Workload((_vit_so400m(False),), _llm_7b(32768), global_batch=8),
                 "W1 at 32K context (the LLM needs CP), global batch 8", 2),
    "W3": Preset(Workload((_vit_so400m(True),), _llm_7b(16384), global_batch=16),
                 "W1 with the vision encoder frozen (forward only)", 2),
    # A 6B-class ViT: InternViT-6B's width (hidden 3200, MLP 12800) with 48 layers and 32 heads
    # instead of its 45 and 25, so that TP up to 8 and PP divide it (5.9B parameters).
    # 448-px tiles of 1024 patches, 12 tiles per sample (InternVL's default dynamic tiling),
    # pixel shuffle to 256 rows per tile, an MLP projector of width 8192; a Llama-70B-shaped LLM
    # (GQA 8 groups, SwiGLU 28672, vocabulary 128256) at 8K; global batch 128 (1M tokens).
    "paper": Preset(Workload(
        (ModuleShape("vision", "encoder", hidden=3200, layers=48, heads=32, ffn=12800, tokens_per_item=1024,
                     items_per_sample=12, output_tokens_per_item=256, projector_ffn=8192),),
        ModuleShape("llm", "llm", hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, gated_mlp=True,
                    seq_length=8192, vocab=128256),
        global_batch=128, distributed_optimizer=True),
        "6B ViT (12 tiles x 1024 tokens, 256 rows each into the LLM) into a 70B LLM at 8K, global batch 128", 64),
}
