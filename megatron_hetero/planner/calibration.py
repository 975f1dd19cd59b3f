"""Hardware figures the cost model turns FLOPs and bytes into seconds with.

The JSON form (tools/check_planner.py writes one fitted to bench_e2e runs; every key is optional, a
missing one takes the default of `Calibration`, an assumption):

    {
      "source": "free text: what was measured, where, when",
      "matmul_tflops": 790,              dense bf16 GEMM throughput one GPU reaches (TFLOPS)
      "max_efficiency": 0.30,            the efficiency curve: the fraction of matmul_tflops a
      "half_efficiency_width": 256,      layer reaches is max_efficiency x w / (w + half width),
                                         w = hidden / tp the GEMM width one GPU gets
      "layer_forward_us_per_token": [    measured: microseconds one GPU spends per token of its
        {"role": "llm", "hidden": 4096,  share on one layer's forward, TP (and CP) communication
         "ffn": 16384, "heads": 32,      included, for one layer shape (role: an encoder attends
         "kv_heads": 32,                 over its item, the LLM causally over its sequence;
         "gated_mlp": false,             sequence: the tokens of that item or sequence) and one
         "sequence": 16384, "tp": 2,     layout (tp, cp); replaces the curve for the layers of that
         "cp": 1, "us": 0.6}             shape and layout (backward = 2 x forward); any other
      ],                                 shape or layout falls back to the curve. kv_heads,
                                         gated_mlp, cp default to heads, false, 1.
                                         tools/check_planner.py fits the curve and these to
                                         bench_e2e runs
      "nvlink_gbps": 350,                collective bus bandwidth inside a node (GB/s)
      "p2p_gbps": 265,                   point-to-point bandwidth inside a node, per direction
      "network_gbps": 40,                per-GPU bandwidth between nodes (collectives and sends)
      "collective_latency_us": 15,       fixed cost of one collective or send
      "boundary_gbps": 200,              colocated boundary re-layout throughput per GPU
      "boundary_call_ms": 0.4,           fixed cost of one boundary exchange (one direction)
      "usable_memory_fraction": 0.9,     share of GPU memory the model may fill
      "activation_memory_factor": 1.0,   measured activation bytes / the formula's (what it leaves
                                         out: autocast's bf16 weight copies, allocator rounding), for
                                         a module whose attention kernel is not known
      "activation_memory_factors": {     the same per module role and attention kernel (the
        "encoder fa4": 1.1, ...},        workload's `attention`), where measured; others take
                                         activation_memory_factor
      "notes": {"key": "measured / assumed, and from what"}
    }
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from megatron_hetero.planner.counts import layer_forward_flops_per_token
from megatron_hetero.planner.shapes import ATTENTION_KERNELS, ModuleShape, positive_int
from megatron_hetero.spec.json_file import load_json

# The calibrations the package ships: the H200 figures the planner assumes by default (its notes say
# where each comes from), and those fitted to measured H100 and H200 runs.
CALIBRATIONS = Path(__file__).with_name("calibrations")


def shipped_calibration(name: str) -> Path:
    """The file of the calibration the package ships as `name` (h200, h200_measured, ...)."""
    return CALIBRATIONS / f"calibration_{name}.json"


def shipped_names() -> list[str]:
    """The names of the calibrations the package ships."""
    return sorted(p.stem.removeprefix("calibration_") for p in CALIBRATIONS.glob("calibration_*.json"))


DEFAULT_CALIBRATION = shipped_calibration("h200")


@dataclass(frozen=True)
class LayerKey:
    """What a measured layer time is for: the layer's shape (`role` encoder attends over one item,
    bidirectionally; llm causally over its sequence), the tokens of that item or sequence, and the
    layout's TP and CP sizes (a GPU holds sequence / cp of those tokens: an encoder's CP splits each
    item)."""

    role: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int = 0  # 0: as many as heads
    gated_mlp: bool = False
    sequence: int = 0
    tp: int = 1
    cp: int = 1

    def __post_init__(self):
        if self.role not in ("encoder", "llm"):
            raise ValueError(f"role {self.role!r} is not valid; use encoder or llm")
        if not isinstance(self.gated_mlp, bool):
            raise ValueError(f"gated_mlp must be true or false, got {self.gated_mlp!r}")
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        for key in ("hidden", "ffn", "heads", "kv_heads", "sequence", "tp", "cp"):
            if not positive_int(getattr(self, key)):
                raise ValueError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        self.shape  # the shape's own checks (heads divide hidden, kv_heads divide heads)

    @classmethod
    def of(cls, shape: ModuleShape, tp: int, cp: int) -> LayerKey:
        sequence = shape.seq_length if shape.role == "llm" else shape.tokens_per_item
        return cls(shape.role, shape.hidden, shape.ffn, shape.heads, shape.kv_groups, shape.gated_mlp, sequence,
                   tp, cp)

    @property
    def shape(self) -> ModuleShape:
        """A one-layer module of this layer's shape (for its FLOPs)."""
        tokens = {"seq_length": self.sequence} if self.role == "llm" else {"tokens_per_item": self.sequence}
        return ModuleShape(self.role, self.role, self.hidden, 1, self.heads, self.ffn, kv_heads=self.kv_heads,
                           gated_mlp=self.gated_mlp, **tokens)

    def describe(self) -> str:
        attention = f"{self.heads} heads" + (f" ({self.kv_heads} K/V)" if self.kv_heads != self.heads else "")
        return (f"{self.role} hidden {self.hidden}, ffn {self.ffn}{' gated' if self.gated_mlp else ''}, "
                f"{attention}, {self.sequence:,} tokens, TP{self.tp}" + (f"/CP{self.cp}" if self.cp > 1 else ""))


def _measured_times(value, matmul_tflops: float) -> dict:
    """{LayerKey: us} from the JSON list (or an already parsed dict); every time at most as fast as
    matmul_tflops allows for its layer's FLOPs."""
    if isinstance(value, dict) and all(isinstance(key, LayerKey) for key in value):
        entries = [{**asdict(key), "us": us} for key, us in value.items()]
    elif isinstance(value, list):
        entries = value
    else:
        raise ValueError("calibration: layer_forward_us_per_token must be a list of {role, hidden, ffn, heads, "
                         "sequence, tp, cp, us} entries, one per measured layer shape and layout (a "
                         "{module: {tp: us}} table applied one shape's times to every module of that name)")
    known = {f.name for f in fields(LayerKey)} | {"us"}
    measured = {}
    for number, entry in enumerate(entries, 1):
        where = f"calibration: layer_forward_us_per_token entry {number}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: must be an object, got {entry!r}")
        unknown = sorted(set(entry) - known)
        missing = [k for k in ("role", "hidden", "ffn", "heads", "sequence", "tp", "us") if k not in entry]
        if unknown or missing:
            raise ValueError(f"{where}: " + "; ".join(
                ([f"unknown keys {', '.join(unknown)}"] if unknown else [])
                + ([f"{', '.join(missing)} missing"] if missing else [])))
        us = entry["us"]
        try:
            key = LayerKey(**{k: v for k, v in entry.items() if k != "us"})
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not (isinstance(us, (int, float)) and not isinstance(us, bool) and us > 0):
            raise ValueError(f"{where}: us must be a positive number of microseconds, got {us!r}")
        tflops = layer_forward_flops_per_token(key.shape) / key.tp / (us * 1e-6) / 1e12
        if tflops > matmul_tflops:
            raise ValueError(f"{where} ({key.describe()}): {us} us per token is {tflops:.0f} TFLOPS per GPU, "
                             f"above matmul_tflops {matmul_tflops:g}")
        if key in measured:
            raise ValueError(f"{where} ({key.describe()}): measured twice; keep one")
        measured[key] = float(us)
    return measured


def _check_factors(factors) -> None:
    """activation_memory_factors: {"<role> <kernel>": positive number}."""
    keys = [f"{role} {kernel}" for role in ("encoder", "llm") for kernel in ATTENTION_KERNELS]
    if not isinstance(factors, dict):
        raise ValueError(f"calibration: activation_memory_factors must be an object keyed by {', '.join(keys)}")
    for key, value in factors.items():
        if key not in keys:
            raise ValueError(f"calibration: activation_memory_factors key {key!r}; use one of {', '.join(keys)}")
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"calibration: activation_memory_factors {key!r} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Calibration:
    """Hardware figures; the defaults are assumptions for one H200 node (see
    megatron_hetero/planner/calibrations/calibration_h200.json for where each comes from)."""

    matmul_tflops: float = 790.0
    max_efficiency: float = 0.30
    half_efficiency_width: float = 256.0
    layer_forward_us_per_token: dict = field(default_factory=dict)  # {LayerKey: us}
    nvlink_gbps: float = 350.0
    p2p_gbps: float = 265.0
    network_gbps: float = 40.0
    collective_latency_us: float = 15.0
    boundary_gbps: float = 200.0
    boundary_call_ms: float = 0.4
    usable_memory_fraction: float = 0.9
    activation_memory_factor: float = 1.0
    activation_memory_factors: dict = field(default_factory=dict)  # {"encoder fa4": factor, ...}
    source: str = "assumed defaults"

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "source" and not isinstance(value, str):
                raise ValueError(f"calibration: source must be a string, got {value!r}")
            if f.name in ("source", "layer_forward_us_per_token", "activation_memory_factors"):
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"calibration: {f.name} must be a non-negative number, got {value!r}")
        for key in ("matmul_tflops", "max_efficiency", "nvlink_gbps", "p2p_gbps", "network_gbps",
                    "boundary_gbps", "usable_memory_fraction", "activation_memory_factor"):
            if getattr(self, key) <= 0:
                raise ValueError(f"calibration: {key} must be positive, got {getattr(self, key)!r}")
        if self.max_efficiency > 1 or self.usable_memory_fraction > 1:
            raise ValueError("calibration: max_efficiency and usable_memory_fraction are fractions of at most 1")
        object.__setattr__(self, "layer_forward_us_per_token",
                           _measured_times(self.layer_forward_us_per_token, self.matmul_tflops))
        _check_factors(self.activation_memory_factors)

    def activation_factor(self, role: str, kernel: str) -> float:
        """The measured activation memory factor of a module of this role whose attention runs on
        `kernel` ("" where not known): activation_memory_factors' entry, else activation_memory_factor."""
        return self.activation_memory_factors.get(f"{role} {kernel}", self.activation_memory_factor)

    def efficiency(self, width: float) -> float:
        """The efficiency curve: the fraction of matmul_tflops a layer reaches when each GPU's GEMMs
        are `width` wide (hidden / tp). Assumption: TP narrows every GEMM of the layer and a narrower
        GEMM (with as many kernel launches) runs further below peak; the token dimension is taken as
        long enough not to matter."""
        return self.max_efficiency * width / (width + self.half_efficiency_width)

    def to_dict(self) -> dict:
        """The JSON form that from_dict reads."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["layer_forward_us_per_token"] = [{**asdict(key), "us": us}
                                              for key, us in self.layer_forward_us_per_token.items()]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        if not isinstance(data, dict):
            raise ValueError(f"calibration must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known | {"notes"}:
                raise ValueError(f"calibration: unknown key {key!r}; known keys: "
                                 f"{', '.join(sorted(known | {'notes'}))}")
        return cls(**{k: v for k, v in data.items() if k != "notes"})

    @classmethod
    def load(cls, path: str) -> Calibration:
        return load_json(path, "calibration", cls.from_dict)

    @classmethod
    def measured(cls, gpu: str) -> Calibration:
        """The shipped calibration fitted to bench_e2e runs on a GPU model (h100, h200)."""
        return cls.load(str(shipped_calibration(f"{gpu}_measured")))
