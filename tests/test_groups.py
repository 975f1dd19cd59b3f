"""Which process groups share a communicator (megatron_hetero/parallel/groups.py): within a module, groups of
the same ranks that only run collectives; one-rank groups across modules; never cp or pp of more
than one rank, never two modules' groups of more than one rank. Rank 0 of a 2-rank world on torch's
fake process group, which makes groups without talking to other processes."""

import dataclasses

import pytest
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_hetero.parallel.groups import build_groups
from megatron_hetero.spec.layout import load_layout
from tests.test_layout import EXAMPLES

FIELDS = [field.name for field in dataclasses.fields(ProcessGroupCollection)]


@pytest.fixture
def rank0_of_two():
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def shared_groups(name: str) -> list[tuple[list[int], set[str]]]:
    """Rank 0's distinct groups of the example layout `name`: (their ranks, the "module.field"s
    that hold each)."""
    holders: dict[int, tuple] = {}
    for module, groups in build_groups(load_layout(str(EXAMPLES / f"{name}.yaml"), 2)).items():
        for field in FIELDS:
            group = getattr(groups.pgs, field, None) if groups.pgs else None
            if group is not None:
                holders.setdefault(id(group), (dist.get_process_group_ranks(group), set()))[1].add(f"{module}.{field}")
    return sorted(holders.values(), key=lambda item: (item[0], sorted(item[1])))


def test_a_colocated_layout_has_three_communicators(rank0_of_two):
    """What benchmarks/gpu_nccl_memory.py measured on 2 H100s (3 groups, 2.8 GiB outside the allocator,
    against 24 groups and 11.4 GiB when every group had its own): one group of rank 0 alone for both
    modules, one for each module's pair."""
    (alone, alone_holders), (_, llm), (_, vision) = shared_groups("gpu2_colocated_sp")  # "llm." < "vision."
    assert alone == [0] and {"vision.tp", "vision.pp", "llm.cp", "llm.pp"} <= alone_holders
    assert {"vision.dp", "vision.dp_cp", "vision.intra_dist_opt"} <= vision
    assert {"llm.tp", "llm.mp", "llm.tp_cp", "llm.tp_dp_cp", "llm.intra_dist_opt"} <= llm
    assert not any(h.startswith("llm") for h in vision) and not any(h.startswith("vision") for h in llm)


@pytest.mark.parametrize("name, own", [("gpu2_colocated_cp2", "llm.cp"), ("gpu2_colocated_pp2", "llm.pp")])
def test_cp_and_pp_keep_their_own(rank0_of_two, name, own):
    """Point-to-point traffic (CP's ring, the pipeline's sends) stays apart from the same ranks'
    collectives (tp_cp, dp_cp, mp and the embedding group here)."""
    groups = shared_groups(name)
    assert ([0, 1], {own}) in groups
    pairs = [holders for ranks, holders in groups if ranks == [0, 1] and own not in holders]
    assert len(pairs) == 2 and all(len(holders) > 1 for holders in pairs)
