"""The input embedding's weight gradient added into main_grad by the lookup's backward (models/embedding.py,
patches/embedding_grad.py): megatron-core's VocabParallelEmbedding under megatron-core's DDP, tokens
repeated within and across two microbatches (the first under no_sync), plain and with the weight also
used by an output projection (tied, megatron's zero_out_wgrad), with and without --overlap-grad-reduce:
main_grad as the upstream lookup leaves it (a dense gradient added by DDP's hook). On CPUs the product
keeps upstream's lookup (into_main_grad: GPUs only); here the rule is widened to this CPU process."""

import contextlib

import torch
import torch.distributed as dist

from tests.distributed import run_distributed

VOCAB, HIDDEN = 40, 8


def _main_grads(into_main_grad: bool, tied: bool, overlap: bool) -> tuple[torch.Tensor, list[bool]]:
    """The embedding weight's main_grad after one step of two microbatches; whether each lookup took
    the path into main_grad."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import VocabParallelEmbedding
    from megatron.core.transformer import TransformerConfig

    from megatron_hetero.models import embedding as embedding_module

    world = dist.group.WORLD
    pgs = ProcessGroupCollection(dp=world, dp_cp=world, intra_dp_cp=world, expt_dp=world, intra_expt_dp=world,
                                 tp=world, pp=world, ep=world, cp=world)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, use_cpu_initialization=True)
    torch.manual_seed(0)
    module = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=torch.nn.init.normal_, config=config, tp_group=world)
    if tied:
        module.weight.zero_out_wgrad = True  # as LanguageModule sets on a weight shared with the output layer
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=overlap), module,
                                  pg_collection=pgs)
    took = []
    widened = lambda weight: took.append(True) or getattr(weight, "main_grad", None) is not None  # noqa: E731
    rule = widened if into_main_grad else (lambda weight: took.append(False) or False)
    embedding_module.into_main_grad, original = rule, embedding_module.into_main_grad
    try:
        ddp.zero_grad_buffer()
        for i in range(2):
            g = torch.Generator().manual_seed(10 + i)
            ids = torch.cat([torch.randint(0, VOCAB, (2, 5), generator=g), torch.full((2, 2), 3)], 1)  # repeats
            with ddp.no_sync() if i == 0 else contextlib.nullcontext():
                out = ddp(ids)
                loss = (out * torch.randn(out.shape, generator=g)).sum()
                if tied:  # the output projection on the same weight: its own gradient through autograd
                    loss = loss + (out.detach() @ module.weight.t()).square().sum()
                loss.backward()
        ddp.finish_grad_sync()
    finally:
        embedding_module.into_main_grad = original
    return module.weight.main_grad.clone(), took


def _compare(rank, world_size):
    from megatron_hetero.patches import apply

    apply()  # the embedding's patch, and the CPU one megatron-core's DDP needs here
    for tied in (False, True):
        for overlap in (False, True):
            want, upstream = _main_grads(False, tied, overlap)
            got, ours = _main_grads(True, tied, overlap)
            assert upstream and not any(upstream) and ours and all(ours)
            assert want.abs().sum() > 0
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{tied=} {overlap=}")


def test_the_gradient_into_main_grad_equals_upstreams_under_ddp():
    run_distributed(_compare, 1)


def test_the_rule_keeps_upstreams_lookup_on_cpus():
    from megatron_hetero.models.embedding import embedding, into_main_grad

    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN))
    weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(VOCAB, HIDDEN), False
    assert not into_main_grad(weight)  # a CPU tensor
    ids = torch.tensor([[1, 2, 2]])
    out = embedding(ids, weight)
    out.sum().backward()
    assert weight.grad is not None and not weight.grad_added_to_main_grad and not weight.main_grad.any()
    torch.testing.assert_close(out, torch.nn.functional.embedding(ids, weight))
