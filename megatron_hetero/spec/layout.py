"""Per-module parallel layouts: dataclasses, YAML parsing, validation, rank coordinates.

Pure Python (no torch): the layout is checked, and every rank's place in every module is known,
before any process group exists (`python -m megatron_hetero.layout check FILE --world-size N`
prints the rank map).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

import yaml

__all__ = [
    "AXES",
    "ColocatedSchedule",
    "EXPERT_AXES",
    "Edge",
    "HeteroLayout",
    "LayoutError",
    "ModuleLayout",
    "Placement",
    "Role",
    "dp_rank_of",
    "dp_samples",
    "load_layout",
    "parse_layout",
]

# Megatron order inside a module: tp fastest, then cp, then dp, then pp.
AXES = ("tp", "cp", "dp", "pp")
# Expert layers' order over the same ranks: expert tp fastest, then ep, expert dp, pp.
EXPERT_AXES = ("etp", "ep", "edp", "pp")


class _Named(StrEnum):
    """A choice of a fixed set, equal to its name as written in files and flags (its one check:
    the constructor, `Placement(text)`)."""

    def __repr__(self) -> str:  # as the plain string (a layout's repr is what checkpoints record)
        return repr(self.value)


class Placement(_Named):
    """How the modules share the ranks."""

    COLOCATED = "colocated"  # every module spans every rank
    NON_COLOCATED = "non_colocated"  # each module on a rank range of its own, disjoint


class Role(_Named):
    ENCODER = "encoder"
    LLM = "llm"


class ColocatedSchedule(_Named):
    """How a colocated rank orders its encoder work around a pipelined LLM's (--hetero-colocated-
    schedule; schedules/colocated.py and colocated_order.py)."""

    RECOMPUTE = "recompute"  # encoder forwards without a graph, the pipeline, each forward again with its backward
    THREE_PHASE = "three-phase"  # every encoder forward, the pipeline, every encoder backward
    BUBBLES = "bubbles"  # encoder work inside the pipeline's warm-up and cool-down


SCHEDULE_FLAG = "--hetero-colocated-schedule"  # the training script's flag choosing a ColocatedSchedule


ROLES = tuple(Role)
PLACEMENTS = tuple(Placement)
TOP_KEYS = ("placement", "modules", "edges")
# A module's boolean settings (each `true` or `false` in a file).
FLAGS = ("sp", "freeze", "cp_replicated", "on_first_stage")
MODULE_KEYS = ("role", "kind", *AXES, *FLAGS, "ranks", "ep", "etp", "microbatches")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_RANKS = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?\Z")


class LayoutError(ValueError):
    """A user mistake in a layout; the message is one line naming the module, field and fix."""


def dp_rank_of(samples, num_samples: int, dp: int):
    """The data-parallel rank (of `dp`) that takes each of `samples` (an int or an integer array) of a
    batch of `num_samples`: each rank a contiguous slice, in rank order, as Megatron splits a batch.
    The rule's one home (dp_samples is its inverse)."""
    return samples // (num_samples // dp)


def dp_samples(num_samples: int, dp: int, dp_rank: int) -> slice:
    """The contiguous slice of a batch of `num_samples` that data-parallel rank `dp_rank` (of `dp`) takes."""
    per_rank = num_samples // dp
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def _placement(value) -> Placement:
    """A layout's placement, checked (the one place)."""
    if not isinstance(value, str) or value not in PLACEMENTS:
        raise LayoutError(f"placement {value!r} is not valid; use placement: colocated or placement: non_colocated")
    return Placement(value)


def _is_int(value) -> bool:
    # YAML `true` is a bool, and bool is an int subclass: refuse it as a size.
    return isinstance(value, int) and not isinstance(value, bool)


def _span(r: range) -> str:
    return f"{r.start}-{r.stop - 1}"


@dataclass(frozen=True)
class ModuleLayout:
    name: str
    role: str
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    sp: bool = False
    freeze: bool = False
    first_rank: int = 0  # global rank of the module's coordinate (0, 0, 0, 0)
    # What an encoder encodes (e.g. vision, audio: a script's registry of encoder kinds decides what
    # it builds); without `kind:` in the file, the module's name.
    kind: str = ""
    # Expert parallelism (the llm's MoE layers): ep ranks split the experts, etp ranks each expert's
    # weights; 0 = Megatron's default, etp = tp. The expert grid (etp, ep, expert dp, pp) covers the
    # same ranks as the dense one: ep x etp divides tp x cp x dp.
    ep: int = 1
    etp: int = 0
    # An encoder's cp ranks as Megatron's homogeneous layout has them under an LLM with CP: each of
    # them encodes the same items whole (the encoder is replicated over the LLM's CP ranks), each
    # sends on the rows its own LLM CP rank takes and gets back their gradients only, and the
    # weight gradients are summed over cp with dp. A baseline to measure against, colocated only.
    cp_replicated: bool = False
    # An encoder stacked on the llm's first pipeline stage, as Megatron's homogeneous layout has it
    # under an LLM with PP (LLaVA, MIMO): its ranks are that stage's, with the llm's tp, cp and dp
    # there, and the later stages hold no encoder. A baseline to measure against, colocated only.
    on_first_stage: bool = False
    # LLM microbatches a colocated encoder encodes in one pass: its forward runs once over the
    # items of k consecutive microbatches (a larger batch per DP rank, balanced over the group),
    # their rows cross the boundary microbatch by microbatch, and its backward runs once per group.
    microbatches: int = 1

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise LayoutError(
                f"module name {self.name!r} is not valid; use letters, digits and _ (e.g. vision)"
            )
        where = f"module {self.name}"
        if not isinstance(self.role, str) or self.role not in ROLES:
            raise LayoutError(f"{where}: role {self.role!r} is not valid; use role: encoder or role: llm")
        object.__setattr__(self, "role", Role(self.role))
        for axis in AXES:
            value = getattr(self, axis)
            if not _is_int(value) or value < 1:
                raise LayoutError(f"{where}: {axis} must be a positive integer, got {value!r}; set {axis}: 1 or more")
        for flag in FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise LayoutError(f"{where}: {flag} must be true or false, got {getattr(self, flag)!r}")
        if self.sp and self.role != "llm":
            # The boundary assumes encoder TP ranks hold full replicas of their output rows.
            raise LayoutError(f"{where}: sp is only supported on the llm; set sp: false")
        if self.sp and self.tp == 1:
            raise LayoutError(f"{where}: sp needs tensor parallelism; set tp > 1 or sp: false")
        if self.cp_replicated and (self.role != "encoder" or self.cp == 1):
            raise LayoutError(f"{where}: cp_replicated replicates an encoder over cp > 1 ranks; set it on an "
                              f"encoder with cp: 2 or more, or remove it")
        if self.on_first_stage and self.role != "encoder":
            raise LayoutError(f"{where}: on_first_stage stacks an encoder on the llm's first pipeline stage; "
                              f"set it on an encoder, or remove it")
        if not _is_int(self.microbatches) or self.microbatches < 1:
            raise LayoutError(f"{where}: microbatches must be a positive integer, got {self.microbatches!r}; "
                              f"set microbatches: 1 or more")
        if self.microbatches > 1 and self.role != "encoder":
            raise LayoutError(f"{where}: microbatches batches an encoder's forward over llm microbatches; "
                              f"set it on an encoder, or remove it")
        if not isinstance(self.kind, str) or (self.kind and not _NAME.match(self.kind)):
            raise LayoutError(f"{where}: kind {self.kind!r} is not valid; use a name such as vision or audio")
        if not self.kind:
            object.__setattr__(self, "kind", self.name)
        if not _is_int(self.first_rank) or self.first_rank < 0:
            raise LayoutError(f"{where}: first rank must be a non-negative integer, got {self.first_rank!r}")
        self._check_experts(where)

    def _check_experts(self, where: str) -> None:
        if self.etp == 0:
            object.__setattr__(self, "etp", self.tp)
        for key in ("ep", "etp"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise LayoutError(f"{where}: {key} must be a positive integer, got {value!r}; set {key}: 1 or more")
        if self.role != "llm" and self.has_expert_grid:
            raise LayoutError(f"{where}: ep/etp split the llm's experts and encoders are dense; remove ep and etp")
        dense = self.tp * self.cp * self.dp
        if dense % (self.ep * self.etp):
            raise LayoutError(
                f"{where}: ep x etp = {self.ep * self.etp} does not divide tp x cp x dp = {dense} (the expert "
                f"groups share a pipeline stage's ranks); use ep x etp dividing {dense}")

    @property
    def has_expert_grid(self) -> bool:
        """Whether the experts are laid out other than the dense layers (ep > 1 or etp != tp)."""
        return self.ep > 1 or self.etp != self.tp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard: the ranks of a stage over ep x etp."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def expert_grid_shape(self) -> list[int]:
        """Shape for megatron-core HyperCommGrid(shape, list(EXPERT_AXES)): Megatron's expert order,
        expert tp fastest, then ep, expert dp, pp (parallel_state's expert rank generator)."""
        return [self.etp, self.ep, self.expert_dp, self.pp]

    def expert_groups(self, axis: str) -> list[list[int]]:
        """The global ranks of each `axis` group (an EXPERT_AXES name) of the expert grid."""
        groups: dict[tuple, list[int]] = {}
        for rank in self.ranks:
            coords = self.expert_coords(rank)
            groups.setdefault(tuple(v for k, v in coords.items() if k != axis), []).append(rank)
        return list(groups.values())

    def expert_coords(self, rank: int) -> dict[str, int] | None:
        if rank not in self.ranks:
            return None
        offset, result = rank - self.first_rank, {}
        for axis, extent in zip(EXPERT_AXES, self.expert_grid_shape()):
            offset, result[axis] = divmod(offset, extent)
        return result

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)

    def grid_shape(self) -> list[int]:
        """Shape for megatron-core HyperCommGrid(shape, list(AXES), rank_offset=first_rank)."""
        return [getattr(self, axis) for axis in AXES]

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        coords = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        offset = 0
        for axis in reversed(AXES):  # Horner's rule, slowest axis first
            extent = getattr(self, axis)
            if not 0 <= coords[axis] < extent:
                raise ValueError(f"module {self.name}: {axis} coordinate {coords[axis]} is outside 0..{extent - 1}")
            offset = offset * extent + coords[axis]
        return self.first_rank + offset

    def dp_samples(self, num_samples: int, dp_rank: int) -> slice:
        """The slice of a batch of `num_samples` this module's data-parallel rank `dp_rank` takes."""
        return dp_samples(num_samples, self.dp, dp_rank)

    def coords(self, rank: int) -> dict[str, int] | None:
        if rank not in self.ranks:
            return None
        offset = rank - self.first_rank
        result = {}
        for axis in AXES:
            offset, result[axis] = divmod(offset, getattr(self, axis))
        return result


@dataclass(frozen=True)
class Edge:
    """Rows from encoder `src` into the llm `dst`: its output into the llm's input, or (DeepStack,
    Qwen3-VL) with layers, the rows of encoder layer `src_layer` added to the output of llm layer
    `dst_layer` (0-based), written 'vision[8] -> llm[0]'."""

    src: str
    dst: str
    src_layer: int | None = None
    dst_layer: int | None = None

    def __post_init__(self):
        for end in (self.src, self.dst):
            if not isinstance(end, str) or not _NAME.match(end):
                raise LayoutError(f"edges: {end!r} is not a module name; write 'ENCODER -> LLM' with module names")
        layers = (self.src_layer, self.dst_layer)
        if any(layer is not None and (not _is_int(layer) or layer < 0) for layer in layers):
            raise LayoutError(f"edges: '{self}' names a layer that is not a number from 0; write e.g. "
                              f"'{self.src}[8] -> {self.dst}[0]'")
        if (self.src_layer is None) != (self.dst_layer is None):
            raise LayoutError(f"edges: '{self}' names a layer at one end only; a DeepStack edge names both, "
                              f"e.g. '{self.src}[8] -> {self.dst}[0]'")

    @property
    def layered(self) -> bool:
        return self.src_layer is not None

    def __str__(self) -> str:
        def end(name, layer):
            return name if layer is None else f"{name}[{layer}]"
        return f"{end(self.src, self.src_layer)} -> {end(self.dst, self.dst_layer)}"


@dataclass(frozen=True)
class HeteroLayout:
    placement: str
    world_size: int
    modules: tuple[ModuleLayout, ...]  # in file order
    edges: tuple[Edge, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "edges", tuple(self.edges))
        object.__setattr__(self, "placement", _placement(self.placement))
        if not _is_int(self.world_size) or self.world_size < 1:
            raise LayoutError(f"world size must be a positive integer, got {self.world_size!r}; use 1 or more")
        if not self.modules:
            raise LayoutError("modules: none given; list at least one module with role: llm")
        names = [m.name for m in self.modules]
        for name in names:
            if names.count(name) > 1:
                raise LayoutError(f"module {name}: defined twice in modules; give each module its own name")
        llms = [m.name for m in self.modules if m.role == "llm"]
        if not llms:
            raise LayoutError("modules: no module has role: llm; set role: llm on exactly one module")
        if len(llms) > 1:
            raise LayoutError(
                f"modules {', '.join(llms)} all have role: llm; keep one and set role: encoder on the others"
            )
        if self.placement == "colocated":
            self._check_colocated()
        else:
            self._check_non_colocated()
        self._check_edges()

    def _check_colocated(self):
        for m in self.modules:
            if m.first_rank != 0:
                raise LayoutError(
                    f"module {m.name} is not colocated with the others: its ranks start at {m.first_rank}, "
                    f"not 0; drop ranks or set placement: non_colocated"
                )
            if m.on_first_stage:
                self._check_first_stage(m)
            elif m.size != self.world_size:
                raise LayoutError(
                    f"module {m.name}: tp*cp*dp*pp = {m.size} but the world size is {self.world_size}; "
                    f"make the product {self.world_size}"
                )

    def _check_first_stage(self, m: ModuleLayout) -> None:
        """An encoder on the llm's first stage (on_first_stage): Megatron's layout there, the
        llm's tp, cp and dp, unpipelined, so that its ranks are exactly that stage's."""
        llm = self.llm
        if llm.pp == 1:
            raise LayoutError(f"module {m.name}: on_first_stage stacks the encoder on the first of the llm's "
                              f"pipeline stages, but the llm has pp: 1; give the llm pp: 2 or more, or remove it")
        want = {"tp": llm.tp, "cp": llm.cp, "dp": llm.dp, "pp": 1}
        if any(getattr(m, axis) != size for axis, size in want.items()):
            got = " ".join(f"{axis}={getattr(m, axis)}" for axis in want)
            fix = ", ".join(f"{axis}: {size}" for axis, size in want.items())
            raise LayoutError(f"module {m.name}: on_first_stage takes the llm's first-stage layout (Megatron's), "
                              f"got {got}; set {fix}")

    def _check_non_colocated(self):
        last = self.world_size - 1
        for m in self.modules:
            for flag, what in (("cp_replicated", "the encoder on the llm's CP ranks"),
                               ("on_first_stage", "the encoder on the llm's first-stage ranks")):
                if getattr(m, flag):
                    raise LayoutError(f"module {m.name}: {flag} is Megatron's colocated baseline ({what}); "
                                      f"use placement: colocated or remove it")
            if m.microbatches > 1:  # its own ranks already stream microbatches through its pipeline
                raise LayoutError(f"module {m.name}: microbatches: {m.microbatches} batches a colocated "
                                  f"encoder's forward; use placement: colocated or set microbatches: 1")
        for m in self.modules:
            if m.ranks.stop > self.world_size:
                raise LayoutError(
                    f"module {m.name}: ranks {_span(m.ranks)} go beyond the world of {self.world_size} ranks; "
                    f"keep ranks within 0-{last}"
                )
        # Walk the modules in rank order: each must start where the previous one stopped.
        next_free, prev = 0, None
        for m in sorted(self.modules, key=lambda m: m.first_rank):
            if m.first_rank < next_free:
                raise LayoutError(
                    f"module {m.name}: ranks {_span(m.ranks)} overlap module {prev.name}'s ranks "
                    f"{_span(prev.ranks)}; make the ranges disjoint"
                )
            if m.first_rank > next_free:
                raise LayoutError(
                    f"ranks {_span(range(next_free, m.first_rank))} belong to no module; extend a module's "
                    f"ranks (e.g. {m.name}) to cover them"
                )
            next_free, prev = m.ranks.stop, m
        if next_free < self.world_size:
            raise LayoutError(
                f"ranks {next_free}-{last} belong to no module; extend a module's ranks to cover them "
                f"or use world size {next_free}"
            )

    def _check_edges(self):
        known = {m.name: m for m in self.modules}
        llm = self.llm.name
        for edge in self.edges:
            for end in (edge.src, edge.dst):
                if end not in known:
                    raise LayoutError(
                        f"edges: '{edge}' names unknown module {end!r}; known modules: {', '.join(known)}"
                    )
            if known[edge.src].role != "encoder":
                raise LayoutError(
                    f"edges: '{edge}' must start at an encoder; {edge.src} has role {known[edge.src].role}"
                )
            if edge.dst != llm:
                raise LayoutError(f"edges: '{edge}' must end at the llm; write '{edge.src} -> {llm}'")
            if self.edges.count(edge) > 1:
                raise LayoutError(f"edges: '{edge}' is listed twice; remove one")
            if edge.layered and Edge(edge.src, edge.dst) not in self.edges:
                raise LayoutError(f"edges: '{edge}' is a DeepStack edge of {edge.src}, whose output edge is missing; "
                                  f"add '{edge.src} -> {edge.dst}'")
            if edge.layered and [e.dst_layer for e in self.edges].count(edge.dst_layer) > 1:
                raise LayoutError(f"edges: '{edge}': {edge.dst} layer {edge.dst_layer} takes rows of one edge only; "
                                  f"give each DeepStack edge its own layer")
        linked = {edge.src for edge in self.edges}
        for m in self.encoders:
            if m.name not in linked:
                raise LayoutError(f"module {m.name}: no edge in edges; add '{m.name} -> {llm}' to edges")

    @property
    def llm(self) -> ModuleLayout:
        return next(m for m in self.modules if m.role == "llm")

    @property
    def encoders(self) -> tuple[ModuleLayout, ...]:
        return tuple(m for m in self.modules if m.role == "encoder")

    def module(self, name: str) -> ModuleLayout:
        for m in self.modules:
            if m.name == name:
                return m
        raise LayoutError(f"no module named {name!r}; known modules: {', '.join(m.name for m in self.modules)}")

    def modules_on(self, rank: int) -> tuple[ModuleLayout, ...]:
        return tuple(m for m in self.modules if rank in m.ranks)

    def rank_map(self) -> str:
        lines = [f"{self.placement} layout, world size {self.world_size}"]
        for m in self.modules:
            sizes = " ".join(f"{axis}{getattr(m, axis)}" for axis in AXES)
            flags = "".join([", sp" if m.sp else "", ", frozen" if m.freeze else "",
                             ", cp replicated" if m.cp_replicated else "",
                             ", on the llm's first stage" if m.on_first_stage else "",
                             f", {m.microbatches} microbatches a pass" if m.microbatches > 1 else ""])
            role = m.role if m.kind == m.name or m.role == "llm" else f"{m.role}, kind {m.kind}"
            if m.has_expert_grid:
                sizes += " | experts " + " ".join(
                    f"{axis}{n}" for axis, n in zip(EXPERT_AXES, m.expert_grid_shape()))
            lines.append(f"{m.name} ({role}): {sizes}, ranks {_span(m.ranks)}{flags}")
            if m.has_expert_grid:
                lines += [f"{m.name} {axis} groups: " + " ".join(
                    "{" + ",".join(map(str, group)) + "}" for group in m.expert_groups(axis))
                    for axis in ("ep", "etp", "edp") if m.expert_grid_shape()[EXPERT_AXES.index(axis)] > 1]
        if self.edges:
            lines.append("edges: " + ", ".join(str(edge) for edge in self.edges))
        for rank in range(self.world_size):
            held = []
            for m in self.modules_on(rank):
                coords = m.coords(rank)
                text = " ".join(f"{axis}{coords[axis]}" for axis in AXES)
                if m.has_expert_grid:
                    expert = m.expert_coords(rank)
                    text += " | " + " ".join(f"{axis}{expert[axis]}" for axis in EXPERT_AXES[:-1])
                held.append(f"{m.name}[{text}]")
            lines.append(f"rank {rank}: " + " ".join(held))
        return "\n".join(lines)


def _parse_ranks(name: str, value) -> range:
    if _is_int(value):
        start = stop = value
    else:
        match = _RANKS.match(value) if isinstance(value, str) else None
        if not match:
            raise LayoutError(
                f"module {name}: ranks {value!r} is not a range; write ranks: START-END (e.g. 1-3) or ranks: N"
            )
        start = int(match[1])
        stop = int(match[2]) if match[2] is not None else start
    if start < 0 or stop < start:
        raise LayoutError(
            f"module {name}: ranks {value!r} is empty or negative; write ranks: START-END with 0 <= START <= END"
        )
    return range(start, stop + 1)


def _parse_module(name, spec, placement: str, world_size: int) -> ModuleLayout:
    if not isinstance(name, str) or not _NAME.match(name):
        raise LayoutError(f"module name {name!r} is not valid; use letters, digits and _ (e.g. vision)")
    where = f"module {name}"
    if not isinstance(spec, dict):
        raise LayoutError(f"{where}: expected a mapping with role, tp, dp, ...; got {type(spec).__name__}")
    for key in spec:
        if key not in MODULE_KEYS:
            raise LayoutError(f"{where}: unknown key {key!r}; allowed keys: {', '.join(MODULE_KEYS)}")
    if "role" not in spec:
        raise LayoutError(f"{where}: role missing; add role: encoder or role: llm")
    if placement == "non_colocated" and "ranks" not in spec:
        raise LayoutError(f"{where}: ranks missing; a non_colocated layout needs ranks: START-END on every module")
    ranks = _parse_ranks(name, spec["ranks"]) if "ranks" in spec else range(world_size)
    if placement == "colocated" and ranks != range(world_size):
        raise LayoutError(
            f"module {name} is not colocated with the others: ranks {_span(ranks)} but a colocated layout "
            f"spans ranks 0-{world_size - 1}; drop ranks or set placement: non_colocated"
        )
    module = ModuleLayout(
        name=name,
        first_rank=ranks.start,
        **{key: spec[key] for key in ("role", "kind", *AXES, *FLAGS, "ep", "etp", "microbatches")
           if key in spec},
    )
    # Colocated sizes are checked against the world by HeteroLayout; here only the explicit range.
    if placement == "non_colocated" and module.size != len(ranks):
        raise LayoutError(
            f"{where}: tp*cp*dp*pp = {module.size} but ranks {_span(ranks)} hold {len(ranks)}; "
            f"make the product {len(ranks)} or change ranks"
        )
    return module


_EDGE_END = re.compile(r"\s*([^\s\[\]]+)\s*(?:\[\s*(\d+)\s*\])?\s*\Z")


def _parse_edge(index: int, item) -> Edge:
    if isinstance(item, str) and item.count("->") == 1:
        ends = [_EDGE_END.match(part) for part in item.split("->")]
        if all(ends):
            (src, src_layer), (dst, dst_layer) = ((m[1], None if m[2] is None else int(m[2])) for m in ends)
            return Edge(src, dst, src_layer, dst_layer)
    if isinstance(item, dict) and {"src", "dst"} <= set(item) <= {"src", "dst", "src_layer", "dst_layer"}:
        return Edge(item["src"], item["dst"], item.get("src_layer"), item.get("dst_layer"))
    raise LayoutError(f"edges[{index}]: {item!r} is not an edge; write 'ENCODER -> LLM' or {{src: ENCODER, dst: LLM}} "
                      f"(a DeepStack edge: 'ENCODER[layer] -> LLM[layer]')")


def parse_layout(data: dict, world_size: int) -> HeteroLayout:
    """Build a validated layout from an already-loaded YAML document."""
    if not isinstance(data, dict):
        got = "an empty document" if data is None else type(data).__name__
        raise LayoutError(f"layout must be a mapping with placement and modules, got {got}")
    for key in data:
        if key not in TOP_KEYS:
            raise LayoutError(f"unknown top-level key {key!r}; allowed keys: {', '.join(TOP_KEYS)}")
    # Checked before the modules so that their range checks know the world.
    if not _is_int(world_size) or world_size < 1:
        raise LayoutError(f"world size must be a positive integer, got {world_size!r}; use 1 or more")
    if "placement" not in data:
        raise LayoutError("placement missing; add placement: colocated or placement: non_colocated")
    placement = _placement(data["placement"])
    modules = data.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise LayoutError("modules missing or empty; give a mapping of module names to settings, one with role: llm")
    parsed = tuple(_parse_module(name, spec, placement, world_size) for name, spec in modules.items())

    if "edges" in data:
        if not isinstance(data["edges"], list):
            raise LayoutError("edges must be a list such as [vision -> llm]")
        edges = tuple(_parse_edge(i, item) for i, item in enumerate(data["edges"]))
    else:
        encoders = [m.name for m in parsed if m.role == "encoder"]
        llms = [m.name for m in parsed if m.role == "llm"]
        if len(encoders) > 1:
            raise LayoutError(
                f"edges missing with {len(encoders)} encoders ({', '.join(encoders)}); "
                f"list one edge per encoder, e.g. edges: [{encoders[0]} -> LLM, ...]"
            )
        # One encoder: its edge to the llm is implied (the llm count is validated below).
        edges = (Edge(encoders[0], llms[0]),) if encoders and len(llms) == 1 else ()
    return HeteroLayout(placement=placement, world_size=world_size, modules=parsed, edges=edges)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: a repeated module name would silently drop one."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            # Only the mapping's own plain keys: merged (`<<: *anchor`) keys may be overridden.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    # PyYAML messages span several lines; keep the problem and where it is.
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return where + " ".join(problem.split())


def load_layout(path: str, world_size: int) -> HeteroLayout:
    """Read and validate a layout file; every failure is a one-line LayoutError starting with the path."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_StrictLoader)
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read layout file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise LayoutError(f"{path}: not UTF-8 text; save the layout file as UTF-8") from None
    except yaml.YAMLError as exc:
        raise LayoutError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    try:
        return parse_layout(data, world_size)
    except LayoutError as exc:
        raise LayoutError(f"{path}: {exc}") from None
