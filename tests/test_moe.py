"""MoE LLM with expert parallelism: examples/pretrain_vlm.py with megatron-core's MoE layers (6
experts top-2, load-balancing and z-loss, the all-to-all dispatcher) reproduces a 1-process run over
10 steps under every layout below (loss, load-balancing loss, z-loss and gradient norm per step
within 1e-4 relative; gradients after the first backward and parameters after the last, expert by
expert, as test_parity checks them), and the router sends every token to the same experts under
every layout (the routing of the first step, token by token); with the distributed optimizer too."""

import json
from pathlib import Path

import pytest

from megatron_hetero.models.context_parallel import cp_positions
from megatron_hetero.spec.layout import load_layout
from tests.test_parity import LAYOUTS, MICRO_BATCH_1, _assert_reproduces, _run, _train_and_capture

MOE = ["--num-experts", "6", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff",
       "0.001", "--moe-token-dispatcher-type", "alltoall"]
METRICS = ("loss", "load_balancing_loss", "z_loss", "grad_norm")
EP3 = ["--global-batch-size", "6"]  # the llm's dp3

# layout: (world size, flags of both runs)
CASES = {
    "moe_colocated_vdp4_ldp4ep2": (4, []),  # vision DP4 -> LLM EP2 (expert DP2)
    "moe_colocated_vtp2dp2_ltp2dp2ep2sp": (4, []),  # vision TP2/DP2 -> LLM TP2/EP2 with SP
    "moe_colocated_vdp4_lpp2dp2ep2": (4, []),  # vision DP4 -> LLM PP2 with EP2
    "moe_non_colocated_1_ep3": (4, EP3),  # vision 1 rank -> LLM EP3 on 3 ranks
    "moe_non_colocated_vdp2_lcp2ep2": (4, []),  # vision DP2 -> LLM CP2/EP2
    "moe_colocated_vdp4_ltp2dp2sp_ep2etp1": (4, []),  # ETP1 under TP2
    "moe_non_colocated_2_2_frozen": (4, []),  # a frozen vision DP2 -> LLM EP2
}


def _train_and_route(rank, world_size, layout_file, out_dir, flags):
    """_train_and_capture, recording every router decision of the first step on this rank: the
    experts each token of each LLM layer went to, keyed by (layer, sample of the global batch,
    sequence position)."""
    from megatron.core.models.mimo.optimizer import MimoOptimizer
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.training import get_args

    calls = {}  # layer -> routing maps [tokens, experts], one per microbatch, in order
    forward, step = TopKRouter.forward, MimoOptimizer.step

    def recording_forward(self, *args, **kwargs):
        probs, routing_map = forward(self, *args, **kwargs)
        if not getattr(MimoOptimizer, "_stepped", False):
            calls.setdefault(self.layer_number, []).append(routing_map.detach().clone())
        return probs, routing_map

    def stepping(self):
        MimoOptimizer._stepped = True
        return step(self)

    TopKRouter.forward, MimoOptimizer.step = recording_forward, stepping
    _train_and_capture(rank, world_size, layout_file, out_dir, flags)
    run, args = get_args().hetero_run, get_args()
    if run.llm.held:
        routes = _token_routes(run.llm, calls, args.micro_batch_size, args.seq_length)
        Path(out_dir, f"routes_rank{rank}.json").write_text(json.dumps(routes))


def _token_routes(llm, calls, micro_batch: int, seq_length: int) -> list:
    """[(layer, global sample, position, experts)] for this rank's tokens: a router's rows are its
    sequence-first [s_local x b_local] tokens, b_local = micro_batch samples of data-parallel rank dp
    in each global microbatch, s_local = the context-parallel rank's positions, split over tp with
    sequence parallelism."""
    layout, coords = llm.layout, llm.coords()
    positions = cp_positions(seq_length, layout.cp, coords["cp"])
    if layout.sp:
        positions = positions.chunk(layout.tp)[coords["tp"]]
    routes = []
    for layer, maps in calls.items():
        for i, routing_map in enumerate(maps):
            first = (i * layout.dp + coords["dp"]) * micro_batch
            for row, experts in enumerate(routing_map.view(len(positions), micro_batch, -1)):
                for b, chosen in enumerate(experts):
                    routes.append((layer, first + b, int(positions[row]), chosen.nonzero().flatten().tolist()))
    return routes


def _routes(out: Path) -> dict:
    routes = {}
    for f in out.glob("routes_rank*.json"):
        for layer, sample, position, experts in json.loads(f.read_text()):
            key = (layer, sample, position)
            assert routes.setdefault(key, experts) == experts, key  # TP replicas route alike
    return routes


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 1-process runs (no expert parallelism), per flags and frozen vision or not, with their
    routes."""
    cache = {}

    def run(flags: list[str], frozen: bool = False):
        key = (tuple(flags), frozen)
        if key not in cache:
            tmp = tmp_path_factory.mktemp("reference")
            layout = LAYOUTS / "single.yaml"
            if frozen:
                layout = tmp / "single_frozen.yaml"
                layout.write_text((LAYOUTS / "single.yaml").read_text()
                                  .replace("role: encoder", "role: encoder\n    freeze: true"))
            cache[key] = _run_moe(tmp / "run", layout, 1, flags)
        return cache[key]

    return run


def _run_moe(out: Path, layout_file: Path, world_size: int, flags: list[str]):
    metrics, tensors = _run(out, layout_file, world_size, [*MOE, *flags], train=_train_and_route)
    return metrics, tensors, _routes(out)


@pytest.mark.parametrize("micro_batch", [pytest.param([], id="mbs2"),  # mbs1: as test_parity's MICRO_BATCH_1_CASES
                                         pytest.param(MICRO_BATCH_1, id="mbs1", marks=pytest.mark.families)])
@pytest.mark.parametrize("layout_name", list(CASES))
def test_moe_layout_reproduces_one_process(reference, tmp_path, layout_name, micro_batch):
    world_size, flags = CASES[layout_name]
    batch = 6 if flags == EP3 else 8
    flags = [*flags, *micro_batch]
    layout = load_layout(LAYOUTS / f"{layout_name}.yaml", world_size)
    assert layout.llm.has_expert_grid
    metrics, tensors, routes = _run_moe(tmp_path / layout_name, LAYOUTS / f"{layout_name}.yaml", world_size, flags)
    frozen = layout.encoders[0].freeze
    ref_metrics, ref_tensors, ref_routes = reference(flags, frozen)
    _assert_reproduces((metrics, tensors), (ref_metrics, ref_tensors), keys=METRICS)
    # Every expert's weights were compared (6 per layer), and the aux losses were really trained.
    assert sum(".local_experts." in name and name.endswith("linear_fc1.weight")
               for name in tensors["llm_grads"]) == 6 * 2
    assert all(m["load_balancing_loss"] > 0 and m["z_loss"] > 0 for m in metrics)
    assert ("vision_grads" in tensors) == (not frozen)
    # Router determinism: every token of the first step, at every layer, went to the same experts.
    assert len(ref_routes) == 2 * batch * 32  # layers x samples x positions
    assert routes == ref_routes


def test_moe_distributed_optimizer(reference, tmp_path):
    """--use-distributed-optimizer with experts sharded over their own expert DP group (ETP1/EP2
    under TP2: expert dp 2, dense dp 2) reproduces the 1-process run; gradients are compared after
    all-gathering the reduced shards of both the dense and the expert buffers."""
    name = "moe_colocated_vdp4_ltp2dp2sp_ep2etp1"
    metrics, tensors, _ = _run_moe(tmp_path / name, LAYOUTS / f"{name}.yaml", 4, ["--use-distributed-optimizer"])
    ref_metrics, ref_tensors, _ = reference([])
    _assert_reproduces((metrics, tensors), (ref_metrics, ref_tensors), keys=METRICS)
