"""The candidates: every way to lay the workload out that megatron-core and the trainer accept
(colocated, non-colocated and Megatron's homogeneous baseline), each with every valid micro batch
size, and a layout file read as candidates."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import product

from megatron_hetero.planner.shapes import Cluster, ModuleShape, Workload
from megatron_hetero.spec import rules
from megatron_hetero.spec.layout import AXES, Edge, HeteroLayout, ModuleLayout

PLACEMENTS = ("colocated", "non_colocated", "homogeneous")


@dataclass(frozen=True)
class Recompute:
    """Megatron's activation recomputation with full granularity, as its flags apply it to every
    module: the first `layers` of each pipeline stage's layers recompute their forward in the
    backward and keep only their input (the block method), the rest keep their activations. `of`
    is the LLM stage's layer count; `layers` >= `of` recomputes every layer of every module (the
    uniform method), so that full recomputation is one choice and partial ones cost less time."""

    layers: int
    of: int

    def __post_init__(self):
        if not 1 <= self.layers <= self.of:
            raise ValueError(f"recompute {self.layers} of {self.of} layers: recompute 1 to {self.of} layers per stage")

    @property
    def full(self) -> bool:
        return self.layers >= self.of

    def of_stage(self, stage_layers: int) -> int:
        """Layers recomputed in a module's stage of `stage_layers` layers."""
        return stage_layers if self.full else min(self.layers, stage_layers)

    def flags(self) -> str:
        """Megatron's flags for it."""
        method = "uniform --recompute-num-layers 1" if self.full else f"block --recompute-num-layers {self.layers}"
        return f"--recompute-granularity full --recompute-method {method}"

    def describe(self) -> str:
        return f"recompute {self.layers}/{self.of} layers"


@dataclass(frozen=True)
class Candidate:
    """One way to run the workload: a placement, one layout per module (encoders in workload
    order, the llm last), the micro batch size and how many layers trainable modules recompute
    (None: none). `homogeneous` is Megatron today: every encoder takes the LLM's tp, cp and dp (an
    encoder does not split an image over CP: it runs replicated on the CP ranks) and sits on the
    LLM's first pipeline stage."""

    placement: str
    layouts: tuple[ModuleLayout, ...]
    micro_batch: int
    recompute: Recompute | None = None

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r} is not valid; use one of {', '.join(PLACEMENTS)}")

    @property
    def llm(self) -> ModuleLayout:
        return self.layouts[-1]

    @property
    def encoders(self) -> tuple[ModuleLayout, ...]:
        return self.layouts[:-1]

    def describe(self) -> str:
        parts = []
        for layout in self.layouts:
            sizes = " ".join(f"{axis}{getattr(layout, axis)}" for axis in (*AXES, "ep") if getattr(layout, axis) > 1)
            flags = "".join([" sp" if layout.sp else "", " frozen" if layout.freeze else "",
                             f" {layout.microbatches} microbatches a pass" if layout.microbatches > 1 else ""])
            where = f" @{layout.ranks.start}-{layout.ranks.stop - 1}" if self.placement == "non_colocated" else ""
            parts.append(f"{layout.name} {sizes or 'x1'}{flags}{where}")
        return " | ".join(parts) + (f" ({self.recompute.describe()})" if self.recompute else "")

    def hetero_layout(self, world_size: int) -> HeteroLayout:
        """The layout file's content (validated by megatron_hetero.layout): the homogeneous baseline
        as the colocated layout whose encoders take the LLM's sizes (cp_replicated under LLM CP,
        on_first_stage under LLM PP)."""
        placement = "colocated" if self.placement == "homogeneous" else self.placement
        modules = self.layouts
        if placement == "colocated":  # the encoders span every rank
            modules = tuple(replace(m, first_rank=0) for m in self.layouts)
        edges = tuple(Edge(e.name, self.llm.name) for e in self.encoders)
        return HeteroLayout(placement=placement, world_size=world_size, modules=modules, edges=edges)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problem(shape: ModuleShape, layout: ModuleLayout, placement: str, cluster: Cluster) -> str | None:
    """Why megatron-core or the trainer would refuse this module layout, or None: the trainer's
    rules (megatron_hetero.spec.rules) for the workload's sizes, with TP within a node (an
    encoder's CP splitting its items' tokens, or replicating them in the homogeneous baseline)."""
    problems = [rules.node_problem(layout, cluster.gpus_per_node),
                rules.heads_problem(layout, shape.heads, "heads"),
                rules.heads_problem(layout, shape.kv_groups, "kv_heads"),
                rules.stages_problem(layout, shape.layers, "layers")]
    if shape.role == "encoder":
        tokens = {"tokens": shape.layer_tokens_per_item, "blocks": 0, "none": None}[shape.cp_split]
        problems += [rules.encoder_cp_problem(layout, tokens, " (tokens_per_item + class_tokens)"),
                     rules.encoder_pp_problem(layout, placement)]
    else:
        problems += [rules.sequence_problem(shape.seq_length, layout),
                     rules.experts_problem(layout, shape.experts or None, shape.topk)]
    return rules.first_problem(*problems)


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
    parallelism is on whenever TP > 1 (it saves memory for the same communication). An MoE LLM
    splits its experts over every EP size within DP x CP (expert TP = TP)."""
    for sizes in _factorizations(gpus, ("tp", "cp", "pp")):
        dp = gpus // (sizes["tp"] * sizes["cp"] * sizes["pp"])
        for ep in _divisors(dp * sizes["cp"]) if shape.experts else [1]:
            layout = ModuleLayout(shape.name, "llm", dp=dp, sp=sizes["tp"] > 1, first_rank=first_rank, ep=ep,
                                  **sizes)
            if layout_problem(shape, layout, "colocated", cluster) is None:
                yield layout


def encoder_layouts(shape: ModuleShape, gpus: int, first_rank: int, cluster: Cluster, placement: str):
    """Every encoder layout on `gpus` GPUs the trainer runs in this placement (CP where it splits
    the items' tokens evenly)."""
    for sizes in _factorizations(gpus, ("tp", "cp", "pp")):
        dp = gpus // (sizes["tp"] * sizes["cp"] * sizes["pp"])
        layout = ModuleLayout(shape.name, "encoder", dp=dp, freeze=shape.frozen, first_rank=first_rank, **sizes)
        if layout_problem(shape, layout, placement, cluster) is None:
            yield layout


def homogeneous_encoder(shape: ModuleShape, llm: ModuleLayout, cluster: Cluster) -> ModuleLayout | None:
    """The encoder as Megatron runs it today: the LLM's tp, cp (replicated) and dp, on its first
    stage (on_first_stage where the LLM has PP); None when it cannot (its heads do not split over
    that TP)."""
    layout = ModuleLayout(shape.name, "encoder", tp=llm.tp, cp=llm.cp, dp=llm.dp, freeze=shape.frozen,
                          cp_replicated=llm.cp > 1, on_first_stage=llm.pp > 1)
    return None if layout_problem(shape, layout, "homogeneous", cluster) else layout


def micro_batches(workload: Workload, layouts: tuple[ModuleLayout, ...]) -> list[int]:
    """Micro batch sizes the trainer accepts for these layouts (rules.batch_problem)."""
    llm, batch = layouts[-1], workload.global_batch
    sizes = [workload.micro_batch] if workload.micro_batch else _divisors(batch // llm.dp)
    return [b for b in sizes if rules.batch_problem(batch, b, llm) is None]


def encoder_batchings(workload: Workload, layouts: tuple[ModuleLayout, ...], micro_batch: int,
                      choose: bool) -> list[tuple[ModuleLayout, ...]]:
    """The layouts with their encoders' microbatches a pass (layout `microbatches`): as given where
    it divides the step's microbatches; with `choose` (colocated candidates), every encoder at each
    k dividing them up to the fewest microbatches whose items split evenly over each encoder's DP
    ranks (a pass of more finds no idle rank to fill: it only holds more activations)."""
    encoders, llm = layouts[:-1], layouts[-1]
    m = workload.global_batch // (micro_batch * llm.dp)
    if not choose:
        return [layouts] if all(rules.encoder_microbatches_problem(e, m) is None for e in encoders) else []
    items = {shape.name: micro_batch * llm.dp * shape.items_per_sample for shape in workload.encoders}
    top = max((e.dp // math.gcd(e.dp, items[e.name]) for e in encoders), default=1)
    return [(*(replace(e, microbatches=k) for e in encoders), llm) for k in _divisors(m) if k <= top]


def _variants(workload: Workload, placement: str, layouts: tuple[ModuleLayout, ...],
              choose_batching: bool = False) -> list[Candidate]:
    """The layouts with every valid micro batch size (and with `choose_batching`, every batching of
    the encoders over microbatches: encoder_batchings), without and (where allowed) with full
    recomputation (search.least_recompute lowers it to the fewest layers that fit)."""
    stage_layers = workload.llm.layers // layouts[-1].pp
    recompute = (None, Recompute(stage_layers, stage_layers)) if workload.allow_recompute else (None,)
    return [Candidate(placement, batched, b, r) for b in micro_batches(workload, layouts)
            for batched in encoder_batchings(workload, layouts, b, choose_batching) for r in recompute]


def is_homogeneous(encoders: tuple[ModuleLayout, ...], llm: ModuleLayout) -> bool:
    """Whether colocated module layouts are Megatron's homogeneous one: every encoder takes the
    LLM's TP, DP and CP (replicated over it), where the LLM has PP sits on its first stage, and
    runs once per microbatch (Megatron has no pass over several)."""
    return all(e.tp == llm.tp and e.dp == llm.dp and e.cp == llm.cp and e.cp_replicated == (llm.cp > 1)
               and e.on_first_stage == (llm.pp > 1) and e.microbatches == 1 for e in encoders)


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
            yield _variants(workload, "colocated", layouts, choose_batching=True)
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
                         f"{layouts[-1].dp} in whole passes of the encoders' microbatches")
    return candidates
