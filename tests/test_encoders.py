"""Modules as pipeline stages: on TP2 x PP2 (4 gloo processes, one launch) every stage of the vision
encoder, the audio encoder and the LLM holds exactly its slice of the whole (pp=1) module built from
the same seed, and the two stages chained reproduce the whole module's output and parameter
gradients bit for bit."""

import pytest
import torch
import torch.distributed as dist

from megatron_hetero.data.batches import caption_batch
from megatron_hetero.data.shapes import ShapesDataset
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.spec.layout import ModuleLayout
from megatron_hetero.spec.sizes import ModelSizes
from tests.distributed import run_distributed

# 4 vision and LLM layers: the second stage's layers 0, 1 are the whole module's 2, 3.
SIZES = ModelSizes(vocab_size=22, enc_num_layers=4, num_layers=4)
SEED, TP, PP, BATCH = 3, 2, 2, 2


def _assert_slice_of_whole(stage, whole, names, pp_rank):
    layers = {int(n.split(".")[2]) for n in names.values() if n.startswith("decoder.layers.")}
    per_stage = whole.config.num_layers // PP
    assert layers == set(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
    params = dict(whole.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, params[names[name]]), f"pp rank {pp_rank}: {name}"


def _check_pipeline(stage, whole, pgs, first, later, hidden_shape):
    """first(module): a first stage (or the whole module) on the raw input; later(module, hidden):
    a later stage fed the previous stage's output. Stage 0 sends its output to the same TP rank of
    stage 1, which sends back the gradient of that input."""
    from megatron_hetero.models.init import whole_names

    pp_rank = pgs.pp.rank()
    peer = dist.get_process_group_ranks(pgs.pp)[1 - pp_rank]
    names = whole_names(stage)
    _assert_slice_of_whole(stage, whole, names, pp_rank)
    want = first(whole)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    (want * weights).sum().backward()
    if pp_rank == 0:
        hidden = first(stage)
        assert hidden.shape == hidden_shape
        dist.send(hidden.detach().contiguous(), peer)
        grad = torch.empty(hidden_shape)
        dist.recv(grad, peer)
        hidden.backward(grad)
    else:
        hidden = torch.empty(hidden_shape)
        dist.recv(hidden, peer)
        hidden.requires_grad_(True)
        got = later(stage, hidden)
        assert torch.equal(got, want)
        (got * weights).sum().backward()
        dist.send(hidden.grad, peer)
    grads = {n: p.grad for n, p in whole.named_parameters()}
    for name, p in stage.named_parameters():
        assert torch.equal(p.grad, grads[names[name]]), f"pp rank {pp_rank}: grad of {name}"


def _check_stages(rank, world_size):
    from megatron_hetero.models.init import build_stage
    from megatron_hetero.models.vlm import build_audio_encoder, build_llm, build_vision_encoder, causal_mask
    from megatron_hetero.parallel import parallel_state
    from megatron_hetero.parallel.groups import build_module_groups
    from megatron_hetero.patches import cpu

    cpu.apply()
    pgs = build_module_groups(ModuleLayout("module", "encoder", tp=TP, pp=PP)).pgs
    parallel_state.init_outside_training(SEED, tp_rank=pgs.tp.rank())

    def stage_and_whole(build):
        stage = build_stage(lambda whole: build(SIZES, TP, pgs, whole=whole), SEED, PP)
        torch.manual_seed(SEED)
        return stage, build(SIZES, TP, pgs, whole=True)

    batch = caption_batch(ShapesDataset(), list(range(BATCH)), CaptionTokenizer(), SIZES.patches_per_image,
                          SIZES.seq_length)
    images, clips = batch.images(slice(None)), batch.audio(slice(None))

    def encoder(module, hidden):  # a later encoder stage takes the hidden states as its argument
        return module(hidden)

    vision = stage_and_whole(build_vision_encoder)
    _check_pipeline(*vision, pgs, lambda m: m(images), encoder,
                    (SIZES.patches_per_image, BATCH, SIZES.enc_hidden_size))
    audio = stage_and_whole(build_audio_encoder)
    _check_pipeline(*audio, pgs, lambda m: m(clips), encoder,
                    (SIZES.tokens_per_clip, BATCH, SIZES.audio_hidden_size))

    s = SIZES.seq_length
    position_ids = torch.arange(s)[None].expand(BATCH, s)
    mask = causal_mask(s, "cpu")

    def llm_first(module):  # per-token losses on the whole module, hidden states [s, b, h] on stage 0
        return module(batch.input_ids, position_ids, mask, labels=batch.labels if module.post_process else None)

    def llm_later(module, hidden):  # megatron-core's way: the input arrives through set_input_tensor
        module.set_input_tensor(hidden)
        return module(None, position_ids, mask, labels=batch.labels)

    llm = stage_and_whole(build_llm)
    _check_pipeline(*llm, pgs, llm_first, llm_later, (s, BATCH, SIZES.hidden_size))

    # Without the copy a later stage draws other weights: the copy is what makes them equal.
    direct = build_stage(lambda whole: build_llm(SIZES, TP, pgs, whole=whole), SEED, PP, layout_independent=False)
    same = [torch.equal(a, b) for a, b in zip(direct.parameters(), llm[0].parameters())]
    assert all(same) if pgs.pp.rank() == 0 else not all(same)


def test_stages_equal_the_whole_module():
    run_distributed(_check_stages, TP * PP)


def test_stage_size_errors():
    from megatron_hetero.models.audio import AudioEncoder
    from megatron_hetero.models.vlm import transformer_config

    with pytest.raises(ValueError, match="pp=2"):
        transformer_config(64, 3, 4, 1, torch.float32, pp=2)
    with pytest.raises(ValueError, match="multiple of 4"):
        AudioEncoder(None, None, mel_bins=16, frames=30, pg_collection=None)
