"""Hardware figures the cost model turns FLOPs and bytes into seconds with.

The JSON form (tools/check_planner.py writes one fitted to bench_e2e runs; every key is optional, a
missing one takes the default of `Calibration`, an assumption):

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

from dataclasses import dataclass, field, fields

from megatron_hetero.planner.shapes import load_json, positive_int


def _tp_cp(key) -> tuple[int, int] | None:
    """A measured layer time's layout key: "2" (TP 2) or "tp1cp2" as (tp, cp); None if neither."""
    if isinstance(key, tuple):  # already parsed (a Calibration copied with dataclasses.replace)
        return key if len(key) == 2 and all(positive_int(n) for n in key) else None
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
        return load_json(path, "calibration", cls.from_dict)
