"""Layout parsing, validation and rank coordinates (pure, no processes except the CLI check)."""

import copy
import itertools
from pathlib import Path

import pytest

from megatron_hetero.spec import rules
from megatron_hetero.spec.layout import (
    AXES,
    Edge,
    HeteroLayout,
    LayoutError,
    ModuleLayout,
    load_layout,
    parse_layout,
)
from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "layouts"


def colocated(**llm_overrides):
    llm = {"role": "llm", "tp": 2, "dp": 2, **llm_overrides}
    return {
        "placement": "colocated",
        "modules": {"vision": {"role": "encoder", "tp": 1, "dp": 4}, "llm": llm},
        "edges": ["vision -> llm"],
    }


def non_colocated():
    return {
        "placement": "non_colocated",
        "modules": {
            "vision": {"role": "encoder", "dp": 1, "ranks": "0-0"},
            "llm": {"role": "llm", "dp": 3, "ranks": "1-3"},
        },
    }


def error_of(data, world_size=4) -> str:
    with pytest.raises(LayoutError) as info:
        parse_layout(data, world_size)
    message = str(info.value)
    assert "\n" not in message and message
    return message


def assert_error(data, world_size, *fragments):
    message = error_of(data, world_size)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# ---- valid files ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, world, shapes",
    [
        ("demo_colocated", 4, {"vision": [1, 1, 4, 1], "llm": [2, 1, 2, 1]}),
        ("colocated_vtp2dp2_ltp1dp4", 4, {"vision": [2, 1, 2, 1], "llm": [1, 1, 4, 1]}),
        ("single", 1, {"vision": [1, 1, 1, 1], "llm": [1, 1, 1, 1]}),
        ("gpu2_colocated", 2, {"vision": [1, 1, 2, 1], "llm": [2, 1, 1, 1]}),
        ("non_colocated_1_3", 4, {"vision": [1, 1, 1, 1], "llm": [1, 1, 3, 1]}),
    ],
)
def test_example_files(name, world, shapes):
    path = EXAMPLES / f"{name}.yaml"
    assert path.read_text().startswith("# ") and f"world size {world}" in path.read_text().splitlines()[0]
    layout = load_layout(str(path), world)
    assert {m.name: m.grid_shape() for m in layout.modules} == shapes
    assert [m.name for m in layout.modules] == ["vision", "llm"]
    assert layout.llm.name == "llm" and [m.name for m in layout.encoders] == ["vision"]
    assert layout.edges == (Edge("vision", "llm"),)
    assert layout.placement == ("non_colocated" if "non" in name else "colocated")


def test_non_colocated_example_ranks():
    layout = load_layout(str(EXAMPLES / "non_colocated_1_3.yaml"), 4)
    assert layout.module("vision").ranks == range(0, 1)
    assert layout.module("llm").ranks == range(1, 4)
    assert layout.modules_on(0) == (layout.module("vision"),)
    assert layout.modules_on(2) == (layout.module("llm"),)


def test_defaults_and_implied_edge():
    data = {
        "placement": "colocated",
        "modules": {
            "vision": {"role": "encoder", "dp": 2, "freeze": True},
            "llm": {"role": "llm", "tp": 2, "sp": True},
        },
    }
    layout = parse_layout(data, 2)
    vision, llm = layout.modules
    assert (vision.tp, vision.cp, vision.dp, vision.pp, vision.sp, vision.freeze) == (1, 1, 2, 1, False, True)
    assert llm.sp and not llm.freeze and llm.first_rank == 0
    assert layout.edges == (Edge("vision", "llm"),)


def test_llm_only_layout_has_no_edges():
    layout = parse_layout({"placement": "colocated", "modules": {"lm": {"role": "llm", "dp": 2}}}, 2)
    assert layout.encoders == () and layout.edges == () and layout.llm.name == "lm"


def test_edge_forms_and_accepted_keys():
    data = colocated()
    data["modules"]["vision"].update(ranks="0-3", ep=1, etp=1)
    data["modules"]["audio"] = {"role": "encoder", "dp": 4, "ranks": "0 - 3"}
    data["edges"] = ["vision->llm", {"src": "audio", "dst": "llm"}]
    layout = parse_layout(data, 4)
    assert layout.edges == (Edge("vision", "llm"), Edge("audio", "llm"))
    assert [m.name for m in layout.encoders] == ["vision", "audio"]


def test_deepstack_edges():
    """DeepStack edges (encoder layer k -> llm layer j) beside the encoder's output edge, in both
    forms; rules.deepstack_problem holds them against a model's (none listed: implied)."""
    from megatron_hetero.spec.rules import deepstack_problem

    data = colocated()
    data["edges"] = ["vision -> llm", "vision[8] -> llm[0]", {"src": "vision", "dst": "llm", "src_layer": 16,
                                                              "dst_layer": 1}]
    layout = parse_layout(data, 4)
    assert layout.edges == (Edge("vision", "llm"), Edge("vision", "llm", 8, 0), Edge("vision", "llm", 16, 1))
    assert "edges: vision -> llm, vision[8] -> llm[0], vision[16] -> llm[1]" in layout.rank_map()
    assert deepstack_problem(layout, "vision", (8, 16)) is None
    assert deepstack_problem(parse_layout(colocated(), 4), "vision", (8, 16)) is None
    problem = deepstack_problem(layout, "vision", (8, 16, 24))
    assert problem.startswith("edges: the layout's DeepStack edges differ from the model's (vision[8] -> llm[0], "
                              "vision[16] -> llm[1], vision[24] -> llm[2])")


def test_bare_int_ranks():
    data = non_colocated()
    data["modules"]["vision"]["ranks"] = 0
    assert parse_layout(data, 4).module("vision").ranks == range(1)


# ---- rank coordinates -------------------------------------------------------------------------

def test_tp_cp_dp_pp_order_by_hand():
    # tp=2, cp=2, dp=2, pp=2 from rank 8: tp is fastest, then cp, then dp, then pp.
    m = ModuleLayout("llm", "llm", tp=2, cp=2, dp=2, pp=2, first_rank=8)
    assert m.rank_of() == 8
    assert m.rank_of(tp=1) == 9
    assert m.rank_of(cp=1) == 10
    assert m.rank_of(dp=1) == 12
    assert m.rank_of(pp=1) == 16
    assert m.rank_of(tp=1, cp=0, dp=1, pp=1) == 8 + 1 + 4 + 8
    assert m.coords(19) == {"tp": 1, "cp": 1, "dp": 0, "pp": 1}
    assert m.grid_shape() == [2, 2, 2, 2] and m.size == 16 and m.ranks == range(8, 24)
    assert AXES == ("tp", "cp", "dp", "pp")
    # Uneven sizes catch a swapped stride: tp=2, cp=3, dp=2, pp=2 from rank 1 has strides 1, 2, 6, 12.
    m = ModuleLayout("v", "encoder", tp=2, cp=3, dp=2, pp=2, first_rank=1)
    assert [m.rank_of(cp=c) for c in range(3)] == [1, 3, 5]
    assert m.rank_of(tp=1, cp=2, dp=1, pp=1) == 1 + 1 + 2 * 2 + 6 * 1 + 12 * 1
    assert m.coords(24) == {"tp": 1, "cp": 2, "dp": 1, "pp": 1}
    assert m.coords(8) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0}


@pytest.mark.parametrize(
    "module",
    [
        ModuleLayout("a", "llm", tp=2, dp=2),
        ModuleLayout("b", "encoder", tp=3, cp=2, dp=2, pp=2, first_rank=5),
        ModuleLayout("c", "llm", tp=2, cp=2, dp=3, pp=2, sp=True, first_rank=1),
        ModuleLayout("d", "encoder"),
    ],
)
def test_rank_coords_round_trip(module):
    seen = []
    for tp, cp, dp, pp in itertools.product(*(range(n) for n in module.grid_shape())):
        rank = module.rank_of(tp=tp, cp=cp, dp=dp, pp=pp)
        assert module.coords(rank) == {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        seen.append(rank)
    assert sorted(seen) == list(module.ranks)
    for rank in module.ranks:
        assert module.rank_of(**module.coords(rank)) == rank
    assert module.coords(module.first_rank - 1) is None
    assert module.coords(module.ranks.stop) is None


def test_rank_coords_round_trip_non_colocated_layout():
    data = {
        "placement": "non_colocated",
        "modules": {
            "vision": {"role": "encoder", "tp": 2, "dp": 2, "ranks": "0-3"},
            "audio": {"role": "encoder", "ranks": 4},
            "llm": {"role": "llm", "tp": 2, "cp": 2, "dp": 2, "pp": 2, "sp": True, "ranks": "5-20"},
        },
        "edges": ["vision -> llm", "audio -> llm"],
    }
    layout = parse_layout(data, 21)
    for rank in range(21):
        (holder,) = layout.modules_on(rank)
        assert holder.rank_of(**holder.coords(rank)) == rank
    assert layout.llm.coords(5) == {"tp": 0, "cp": 0, "dp": 0, "pp": 0}
    assert layout.llm.coords(20) == {"tp": 1, "cp": 1, "dp": 1, "pp": 1}


def test_rank_of_out_of_range_coordinate():
    with pytest.raises(ValueError, match="dp coordinate 2"):
        ModuleLayout("llm", "llm", dp=2).rank_of(dp=2)


# ---- rank map ---------------------------------------------------------------------------------

def test_rank_map_colocated():
    text = parse_layout(colocated(sp=True), 4).rank_map()
    lines = text.splitlines()
    assert "vision (encoder): tp1 cp1 dp4 pp1, ranks 0-3" in lines
    assert "llm (llm): tp2 cp1 dp2 pp1, ranks 0-3, sp" in lines
    assert "rank 0: vision[tp0 cp0 dp0 pp0] llm[tp0 cp0 dp0 pp0]" in lines
    assert "rank 3: vision[tp0 cp0 dp3 pp0] llm[tp1 cp0 dp1 pp0]" in lines
    assert sum(line.startswith("rank ") for line in lines) == 4
    # Module summaries come before the per-rank lines.
    assert lines.index("vision (encoder): tp1 cp1 dp4 pp1, ranks 0-3") < lines.index(
        "rank 0: vision[tp0 cp0 dp0 pp0] llm[tp0 cp0 dp0 pp0]"
    )


def test_encoder_microbatches_a_pass():
    """`microbatches: k` on a colocated encoder: one pass over k llm microbatches, k dividing the
    step's microbatches; under a pipelined llm with the recompute schedule only."""
    layout = parse_layout(with_module(colocated(), "vision", microbatches=2), 4)
    vision = layout.module("vision")
    assert vision.microbatches == 2 and layout.llm.microbatches == 1
    assert "vision (encoder): tp1 cp1 dp4 pp1, ranks 0-3, 2 microbatches a pass" in layout.rank_map().splitlines()
    assert rules.encoder_microbatches_problem(vision, 4) is None
    assert rules.encoder_microbatches_problem(vision, 3) == (
        "module vision: microbatches: 2 does not divide the step's 3 llm microbatches (--global-batch-size / "
        "(--micro-batch-size x llm dp)); use a divisor of 3")
    piped = parse_layout(with_module(colocated(tp=1, pp=2), "vision", microbatches=2), 4)
    assert rules.colocated_schedule_problem("colocated", piped.llm, "recompute", piped.encoders) is None
    assert rules.colocated_schedule_problem("colocated", piped.llm, "bubbles", piped.encoders) == (
        "module vision: microbatches: 2 runs under the recompute schedule, not --hetero-colocated-schedule "
        "bubbles; drop the flag or set microbatches: 1")


def stacked(**vision):
    """Megatron's layout under LLM PP: the encoder on the LLM's first stage (ranks 0-1 of 4)."""
    return {"placement": "colocated",
            "modules": {"vision": {"role": "encoder", "dp": 2, "on_first_stage": True, **vision},
                        "llm": {"role": "llm", "dp": 2, "pp": 2}}}


def test_encoder_on_the_llm_first_stage():
    """on_first_stage: the encoder holds the llm's first-stage ranks only, with its tp, cp and dp."""
    layout = parse_layout(stacked(), 4)
    assert layout.module("vision").ranks == range(2) and layout.llm.ranks == range(4)
    assert [m.name for m in layout.modules_on(2)] == ["llm"]
    lines = layout.rank_map().splitlines()
    assert "vision (encoder): tp1 cp1 dp2 pp1, ranks 0-1, on the llm's first stage" in lines
    assert "rank 1: vision[tp0 cp0 dp1 pp0] llm[tp0 cp0 dp1 pp0]" in lines
    assert "rank 3: llm[tp0 cp0 dp1 pp1]" in lines
    example = load_layout(str(EXAMPLES / "gpu2_homogeneous_pp2_stacked.yaml"), 2)
    assert example.module("vision").on_first_stage and example.module("vision").ranks == range(1)
    replicated = stacked(cp=2, dp=1, cp_replicated=True)  # under llm cp: replicated over it, as Megatron
    replicated["modules"]["llm"].update(cp=2, dp=1)
    assert parse_layout(replicated, 4).module("vision").ranks == range(2)


def test_rank_map_non_colocated():
    lines = parse_layout(non_colocated(), 4).rank_map().splitlines()
    assert "llm (llm): tp1 cp1 dp3 pp1, ranks 1-3" in lines
    assert "rank 0: vision[tp0 cp0 dp0 pp0]" in lines
    assert "rank 3: llm[tp0 cp0 dp2 pp0]" in lines


def test_rank_map_expert_groups():
    """Megatron's expert order over a stage's ranks: expert tp fastest, then ep, expert dp."""
    lines = parse_layout(colocated(sp=True, ep=2, etp=1), 4).rank_map().splitlines()
    assert "llm (llm): tp2 cp1 dp2 pp1 | experts etp1 ep2 edp2 pp1, ranks 0-3, sp" in lines
    assert "llm ep groups: {0,1} {2,3}" in lines
    assert "llm edp groups: {0,2} {1,3}" in lines
    assert "rank 1: vision[tp0 cp0 dp1 pp0] llm[tp1 cp0 dp0 pp0 | etp0 ep1 edp0]" in lines
    lines = parse_layout(colocated(sp=True, ep=2), 4).rank_map().splitlines()  # etp = tp by default
    assert "llm (llm): tp2 cp1 dp2 pp1 | experts etp2 ep2 edp1 pp1, ranks 0-3, sp" in lines
    assert "llm etp groups: {0,1} {2,3}" in lines and "llm ep groups: {0,2} {1,3}" in lines
    pp = ModuleLayout("llm", "llm", cp=2, pp=2, ep=2, first_rank=1)
    assert pp.expert_groups("ep") == [[1, 2], [3, 4]] and pp.expert_dp == 1
    assert pp.expert_coords(4) == {"etp": 0, "ep": 1, "edp": 0, "pp": 1}
    dense = ModuleLayout("llm", "llm", tp=2, dp=2)  # no expert grid of its own: not printed
    assert not dense.has_expert_grid and dense.etp == 2
    assert "experts" not in parse_layout(colocated(), 4).rank_map()


# ---- errors -----------------------------------------------------------------------------------

def with_module(data, name, **changes):
    data = copy.deepcopy(data)
    data["modules"][name].update(changes)
    return data


@pytest.mark.parametrize(
    "data, world, fragments",
    [
        # top level
        ({**colocated(), "modlues": {}}, 4, ["'modlues'", "allowed keys: placement, modules, edges"]),
        ({**colocated(), "placement": "mixed"}, 4, ["placement 'mixed'", "colocated", "non_colocated"]),
        ({k: v for k, v in colocated().items() if k != "placement"}, 4, ["placement missing"]),
        ({"placement": "colocated"}, 4, ["modules missing"]),
        ({"placement": "colocated", "modules": {}}, 4, ["modules missing or empty"]),
        (colocated(), 0, ["world size", "got 0"]),
        # module keys and values
        (with_module(colocated(), "llm", tpp=2), 4,
         ["module llm", "'tpp'", "allowed keys: role, kind, tp, cp, dp, pp"]),
        (with_module(colocated(), "vision", tp=0, dp=4), 4, ["module vision", "tp must be a positive integer"]),
        (with_module(colocated(), "vision", dp=-4), 4, ["module vision", "dp must be a positive integer"]),
        (with_module(colocated(), "vision", dp="4"), 4, ["module vision", "dp must be a positive integer", "'4'"]),
        (with_module(colocated(), "vision", dp=4.0), 4, ["module vision", "dp must be a positive integer"]),
        (with_module(colocated(), "vision", pp=True), 4, ["module vision", "pp must be a positive integer"]),
        (with_module(colocated(), "llm", sp="yes"), 4, ["module llm", "sp must be true or false"]),
        (with_module(colocated(), "vision", freeze=1), 4, ["module vision", "freeze must be true or false"]),
        (with_module(colocated(), "vision", role="decoder"), 4, ["module vision", "role 'decoder'", "role: encoder"]),
        ({**colocated(), "modules": {"vision": {"dp": 4}, "llm": {"role": "llm", "dp": 4}}}, 4,
         ["module vision", "role missing"]),
        ({**colocated(), "modules": {"vision": 4, "llm": {"role": "llm", "dp": 4}}}, 4,
         ["module vision", "expected a mapping"]),
        ({**colocated(), "modules": {"my vision": {"role": "encoder"}}}, 1, ["module name 'my vision'"]),
        (with_module(colocated(), "llm", ep=8), 4, ["module llm", "ep x etp = 16 does not divide tp x cp x dp = 4",
                                                    "use ep x etp dividing 4"]),
        (with_module(colocated(), "llm", ep=2, etp=4), 4, ["module llm", "ep x etp = 8 does not divide"]),
        (with_module(colocated(), "llm", ep=0), 4, ["module llm", "ep must be a positive integer"]),
        (with_module(colocated(), "llm", etp="2"), 4, ["module llm", "etp must be a positive integer"]),
        (with_module(colocated(), "vision", ep=2), 4, ["module vision", "encoders are dense", "remove ep and etp"]),
        (with_module(colocated(), "vision", etp=2), 4, ["module vision", "encoders are dense"]),
        (with_module(colocated(), "llm", tp=1, dp=4, sp=True), 4, ["module llm", "set tp > 1 or sp: false"]),
        (with_module(colocated(), "vision", tp=2, dp=2, sp=True), 4,
         ["module vision", "sp is only supported on the llm"]),
        # sizes against the world
        (with_module(colocated(), "llm", tp=3, dp=2), 4,
         ["module llm: tp*cp*dp*pp = 6 but the world size is 4; make the product 4"]),
        (with_module(colocated(), "vision", ranks="0-1"), 4,
         ["module vision is not colocated with the others", "ranks 0-1", "placement: non_colocated"]),
        (with_module(non_colocated(), "llm", dp=2), 4,
         ["module llm", "tp*cp*dp*pp = 2", "ranks 1-3", "make the product 3"]),
        # non-colocated ranges
        (with_module(non_colocated(), "llm", ranks=None), 4, ["module llm", "ranks None is not a range"]),
        ({**non_colocated(), "modules": {"vision": {"role": "encoder", "ranks": 0}, "llm": {"role": "llm", "dp": 3}}},
         4, ["module llm", "ranks missing"]),
        (with_module(non_colocated(), "llm", ranks="3-1"), 4, ["module llm", "ranks '3-1'", "START <= END"]),
        (with_module(non_colocated(), "llm", ranks="1..3"), 4, ["module llm", "ranks '1..3'", "START-END"]),
        (with_module(non_colocated(), "llm", ranks="2-4"), 4, ["module llm", "ranks 2-4", "within 0-3"]),
        (with_module(non_colocated(), "vision", dp=2, ranks="0-1"), 4,
         ["module llm", "ranks 1-3 overlap module vision's ranks 0-1", "disjoint"]),
        (with_module(non_colocated(), "llm", dp=2, ranks="2-3"), 4, ["ranks 1-1 belong to no module", "llm"]),
        (with_module(non_colocated(), "llm", dp=2, ranks="1-2"), 4, ["ranks 3-3 belong to no module", "world size 3"]),
        # llm count
        (with_module(colocated(), "vision", role="llm"), 4, ["modules vision, llm", "role: llm"]),
        (with_module(colocated(), "llm", role="encoder"), 4, ["no module has role: llm"]),
        # edges
        ({**colocated(), "edges": ["audio -> llm"]}, 4,
         ["edges", "unknown module 'audio'", "known modules: vision, llm"]),
        ({**colocated(), "edges": ["vision -> lm"]}, 4, ["edges", "unknown module 'lm'"]),
        ({**colocated(), "edges": ["llm -> llm"]}, 4, ["edges", "'llm -> llm'", "must start at an encoder"]),
        ({**colocated(), "modules": {**colocated()["modules"], "audio": {"role": "encoder", "dp": 4}},
          "edges": ["vision -> audio", "audio -> llm"]}, 4,
         ["edges", "'vision -> audio'", "must end at the llm", "write 'vision -> llm'"]),
        ({**colocated(), "edges": ["vision -> llm", "vision -> llm"]}, 4, ["edges", "listed twice"]),
        ({**colocated(), "edges": []}, 4, ["module vision", "no edge in edges", "vision -> llm"]),
        ({**colocated(), "edges": "vision -> llm"}, 4, ["edges must be a list"]),
        ({**colocated(), "edges": ["vision => llm"]}, 4, ["edges[0]", "'vision => llm'", "ENCODER -> LLM"]),
        ({**colocated(), "edges": ["vision -> llm", "vision[8] -> llm"]}, 4,
         ["edges", "'vision[8] -> llm'", "a layer at one end only", "'vision[8] -> llm[0]'"]),
        ({**colocated(), "edges": ["vision[8] -> llm[0]"]}, 4, ["'vision[8] -> llm[0]'", "add 'vision -> llm'"]),
        ({**colocated(), "edges": ["vision -> llm", "vision[8] -> llm[0]", "vision[9] -> llm[0]"]}, 4,
         ["llm layer 0 takes rows of one edge only"]),
        ({**colocated(), "edges": [{"src": "vision"}]}, 4, ["edges[0]", "src"]),
        ({"placement": "colocated", "modules": {**colocated()["modules"], "audio": {"role": "encoder", "dp": 4}}}, 4,
         ["edges missing with 2 encoders (vision, audio)"]),
        # an encoder on the llm's first stage (on_first_stage)
        (stacked(on_first_stage="yes"), 4, ["module vision", "on_first_stage must be true or false"]),
        (with_module(stacked(), "llm", on_first_stage=True), 4,
         ["module llm", "on_first_stage stacks an encoder", "set it on an encoder"]),
        (with_module(colocated(), "vision", on_first_stage=True), 4,
         ["module vision", "the llm has pp: 1", "give the llm pp: 2 or more, or remove it"]),
        (stacked(tp=2, dp=1), 4, ["module vision: on_first_stage takes the llm's first-stage layout",
                                  "got tp=2 cp=1 dp=1 pp=1", "set tp: 1, cp: 1, dp: 2, pp: 1"]),
        (stacked(dp=4), 4, ["module vision: on_first_stage", "got tp=1 cp=1 dp=4 pp=1", "set tp: 1, cp: 1, dp: 2"]),
        (stacked(dp=1, pp=2), 4, ["module vision: on_first_stage", "got tp=1 cp=1 dp=1 pp=2", "pp: 1"]),
        (with_module(non_colocated(), "vision", on_first_stage=True), 4,
         ["module vision: on_first_stage is Megatron's colocated baseline", "use placement: colocated"]),
        # an encoder's pass over several llm microbatches (microbatches)
        (with_module(colocated(), "vision", microbatches=0), 4,
         ["module vision: microbatches must be a positive integer, got 0", "set microbatches: 1 or more"]),
        (with_module(colocated(), "vision", microbatches=True), 4, ["module vision: microbatches must be"]),
        (with_module(colocated(), "llm", microbatches=2), 4,
         ["module llm: microbatches batches an encoder's forward", "set it on an encoder, or remove it"]),
        (with_module(non_colocated(), "vision", microbatches=2), 4,
         ["module vision: microbatches: 2 batches a colocated encoder's forward",
          "use placement: colocated or set microbatches: 1"]),
    ],
)
def test_errors(data, world, fragments):
    assert_error(data, world, *fragments)


def test_parse_layout_rejects_non_mapping():
    assert_error(["vision", "llm"], 4, "layout must be a mapping", "list")


def test_direct_construction_errors_are_one_line():
    vision = ModuleLayout("vision", "encoder", dp=2)
    llm = ModuleLayout("llm", "llm", dp=2)
    cases = [
        (lambda: HeteroLayout("colocated", 2, (vision, llm, llm), (Edge("vision", "llm"),)),
         "module llm: defined twice"),
        (lambda: HeteroLayout("colocated", 2, (), ()), "modules: none given"),
        (lambda: HeteroLayout("colocated", 2, (ModuleLayout("llm", "llm", dp=2, first_rank=1),)),
         "module llm is not colocated with the others"),
        (lambda: HeteroLayout("colocated", -1, (llm,)), "world size must be a positive integer"),
        (lambda: ModuleLayout("llm", "llm", first_rank=-1), "module llm: first rank"),
        (lambda: Edge("vision", ""), "edges: '' is not a module name"),
    ]
    for build, fragment in cases:
        with pytest.raises(LayoutError) as info:
            build()
        assert fragment in str(info.value) and "\n" not in str(info.value)


def test_module_lookup():
    layout = parse_layout(colocated(), 4)
    assert layout.module("llm") is layout.llm
    with pytest.raises(LayoutError, match="no module named 'audio'; known modules: vision, llm"):
        layout.module("audio")


# ---- files ------------------------------------------------------------------------------------

def load_error(tmp_path, text, world=4) -> str:
    path = tmp_path / "layout.yaml"
    path.write_text(text)
    with pytest.raises(LayoutError) as info:
        load_layout(str(path), world)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path))
    return message


def test_yaml_anchors_and_merge_keys(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text(
        "placement: colocated\n"
        "modules:\n"
        "  vision: &encoder {role: encoder, dp: 4}\n"
        "  audio: {<<: *encoder, tp: 2, dp: 2}\n"
        "  llm: {role: llm, dp: 4}\n"
        "edges: [vision -> llm, audio -> llm]\n"
    )
    audio = load_layout(str(path), 4).module("audio")
    assert (audio.role, audio.tp, audio.dp) == ("encoder", 2, 2)


def test_load_errors(tmp_path):
    with pytest.raises(LayoutError, match="cannot read layout file") as info:
        load_layout(str(tmp_path / "missing.yaml"), 4)
    assert "\n" not in str(info.value)
    bad_yaml = load_error(tmp_path, "placement: colocated\nmodules: [\n  : :\n")
    assert "not valid YAML: line 3, column 3: expected the node content" in bad_yaml
    assert "layout must be a mapping with placement and modules, got list" in load_error(tmp_path, "- a\n- b\n")
    assert "key 'vision' appears twice" in load_error(
        tmp_path, "placement: colocated\nmodules:\n  vision: {role: encoder}\n  vision: {role: llm}\n"
    )
    assert "got an empty document" in load_error(tmp_path, "# nothing here\n")
    assert "module llm: tp*cp*dp*pp = 6" in load_error(
        tmp_path, "placement: colocated\nmodules:\n  llm: {role: llm, tp: 3, dp: 2}\n"
    )


# ---- CLI --------------------------------------------------------------------------------------

def run_cli(*args):
    return run_python(["-m", "megatron_hetero.layout", *args], cwd=ROOT)


def test_cli_valid_file():
    result = run_cli("check", "examples/layouts/demo_colocated.yaml", "--world-size", "4")
    assert result.returncode == 0, result.stderr
    assert "rank 1: vision[tp0 cp0 dp1 pp0] llm[tp1 cp0 dp0 pp0]" in result.stdout.splitlines()
    assert result.stderr == ""


def test_cli_args_from_file(tmp_path):
    args = tmp_path / "args.txt"
    args.write_text("check\nexamples/layouts/non_colocated_1_3.yaml\n--world-size\n4\n")
    result = run_cli(f"@{args}")
    assert result.returncode == 0, result.stderr
    assert "rank 0: vision[tp0 cp0 dp0 pp0]" in result.stdout


@pytest.mark.parametrize(
    "file, world, fragment",
    [
        ("examples/layouts/demo_colocated.yaml", "2", "tp*cp*dp*pp = 4 but the world size is 2"),
        ("examples/layouts/no_such_file.yaml", "4", "cannot read layout file"),
    ],
)
def test_cli_invalid(file, world, fragment):
    result = run_cli("check", file, "--world-size", world)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_layout_is_valid_for_one_world_size(path):
    valid = []
    for world_size in range(1, 9):
        try:
            load_layout(str(path), world_size)
            valid.append(world_size)
        except LayoutError:
            pass
    assert len(valid) == 1, (path.name, valid)


def test_kind_names_what_an_encoder_encodes():
    """`kind:` decides what an encoder is, so any module name works; without it the name is the kind
    (today's layout files); a kind must be a name."""
    spec = {"placement": "colocated", "modules": {"camera": {"role": "encoder", "kind": "vision"},
                                                  "llm": {"role": "llm"}}}
    layout = parse_layout(spec, 1)
    assert [(m.name, m.kind) for m in layout.encoders] == [("camera", "vision")]
    legacy = parse_layout({"placement": "colocated", "modules": {"audio": {"role": "encoder"},
                                                                 "llm": {"role": "llm"}}}, 1)
    assert legacy.encoders[0].kind == "audio"
    spec["modules"]["camera"]["kind"] = "3d"
    with pytest.raises(LayoutError, match="kind '3d' is not valid"):
        parse_layout(spec, 1)
