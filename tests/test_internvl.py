"""InternVL (families/internvl): tiny random transformers InternVLForConditionalGeneration models
(tests/internvl_models.py) imported into our vision module (InternViT, pixel shuffle, projector) and
LLM reproduce transformers' logits within 1e-4 (fp32) on a batch of several tiles and a sample with
none, on one rank and with the vision module and the LLM each split TP2 or PP2 (2 gloo processes, one
launch for every case); the weight mapping both ways, in transformers' and the Hub's key names."""

import pytest
import torch
import torch.distributed as dist

from megatron_hetero.families import family_named
from megatron_hetero.hf import HFMappingError
from megatron_hetero.spec.sizes import ModelSizes
from tests.compiling import assert_compiled_equals_eager
from tests.distributed import collect_distributed
from tests.internvl_models import (
    CONFIGS,
    IMAGE_TOKEN,
    ROWS_PER_TILE,
    VOCAB,
    batch,
    hf_config,
    hf_model,
    internvl_dir,
)
from tests.test_hf import _run_stages

TOL = 1e-4
SEQ = 64
# layout -> ModuleLayout sizes of both modules on 2 ranks ("one_rank": each rank a whole model, dp 2)
LAYOUTS = {"one_rank": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2)}
BATCHES = {"tiles_3_0": (3, 0), "tiles_1_2": (1, 2), "no_images": (0, 0)}


def _imported(name: str):
    hf = hf_model(name)
    family = family_named("internvl")
    sizes = family.sizes(hf.config, ModelSizes(seq_length=SEQ))
    return hf, family, sizes, family.to_ours(hf.state_dict(), sizes)


def _from_last_stage(x, pgs, shape):
    """The last pipeline stage's tensor on every rank of the pipeline."""
    if pgs.pp.size() == 1:
        return x
    x = x if x is not None else torch.empty(shape)
    dist.broadcast(x, dist.get_process_group_ranks(pgs.pp)[-1], group=pgs.pp)
    return x


@torch.no_grad()
def _case(name: str, layout: str, vision, llm, sizes, pgs) -> dict:
    from megatron_hetero.models.vlm import llm_forward

    pairs = {}
    for batch_name, tiles in BATCHES.items():
        ids, pixels = batch(tiles, SEQ)
        hf = _HF[name]
        want = hf(input_ids=ids, pixel_values=pixels if len(pixels) else None).logits
        tokens = 1 + sizes.patches_per_image
        rows = torch.empty(0, sizes.hidden_size)
        if len(pixels):
            rows = _run_stages(vision, pgs, pixels, lambda m, x: m(x), (tokens, len(pixels), sizes.enc_hidden_size))
            rows = _from_last_stage(rows, pgs, (ids.eq(IMAGE_TOKEN).sum().item(), sizes.hidden_size))
        # transformers fills image tokens sample by sample; our embedding is [s, b, h]: row s * b + sample
        sample, position = ids.eq(IMAGE_TOKEN).nonzero(as_tuple=True)
        at = position * ids.shape[0] + sample
        positions = torch.arange(SEQ)[None].expand(ids.shape[0], -1)

        def forward(model, hidden):
            if model.pre_process:
                return llm_forward(model, ids, positions, [(rows, at)])
            return llm_forward(model, ids, positions, [], hidden=hidden)

        logits = _run_stages(llm, pgs, None, forward, (SEQ, ids.shape[0], sizes.hidden_size))
        if logits is not None:
            pairs[batch_name] = (logits[..., :VOCAB], want)
    return pairs


_HF = {}


def _worker(rank, world_size):
    from megatron_hetero.models.full_state import load_full_tensors
    from megatron_hetero.models.vlm import build_llm
    from megatron_hetero.parallel.groups import build_module_groups
    from megatron_hetero.parallel.parallel_state import init_outside_training
    from megatron_hetero.patches import cpu
    from megatron_hetero.spec.layout import ModuleLayout

    cpu.apply()
    init_outside_training(0, tp_rank=0)
    results = {}
    for name in CONFIGS:
        hf, family, sizes, states = _imported(name)
        _HF[name] = hf
        for layout, dims in LAYOUTS.items():
            groups = {m: build_module_groups(ModuleLayout(f"{name}_{layout}_{m}", role, **dims)).pgs
                      for m, role in (("vision", "encoder"), ("llm", "llm"))}
            vision = family.build_vision(sizes, groups["vision"].tp.size(), groups["vision"]).eval()
            llm = build_llm(sizes, groups["llm"].tp.size(), groups["llm"]).eval()
            load_full_tensors(vision, states["vision"], groups["vision"].tp)
            load_full_tensors(llm, states["llm"], groups["llm"].tp)
            # both modules share the ranks' pipeline order here: the vision's pgs for its stages
            results[f"{name}/{layout}"] = _case(name, layout, vision, llm, sizes, groups["vision"])
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return collect_distributed(_worker, 2, tmp_path_factory.mktemp("internvl"))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_equal_transformers(runs, name, layout):
    """Several tiles in a sample, a sample without images, a batch without images: logits within 1e-4."""
    pairs = [p for rank_results in runs for p in rank_results[f"{name}/{layout}"].items()]
    assert {batch_name for batch_name, _ in pairs} == set(BATCHES)
    for batch_name, (got, want) in pairs:
        diff = (got - want).abs().max().item()
        print(f"{name} {layout} {batch_name}: max |ours - transformers| = {diff:.2e} (scale {want.abs().max():.2f})")
        assert diff <= TOL, f"{batch_name}: {diff}"


# ---- the mapping (one process) --------------------------------------------------------------------
def _opengvlab_spelled(state: dict[str, torch.Tensor], sizes) -> dict[str, torch.Tensor]:
    """transformers' tensors (in memory) renamed (and q/k/v fused) as OpenGVLab's original checkpoints
    spell them (transformers' convert_internvl_weights_to_hf.py's mapping, inverted), written here
    independently of the family's tables."""
    out, hidden = {}, sizes.enc_hidden_size
    renames = [("model.vision_tower.", "vision_model."), ("encoder.layer.", "encoder.layers."),
               ("embeddings.cls_token", "embeddings.class_embedding"),
               ("embeddings.position_embeddings", "embeddings.position_embedding"),
               ("patch_embeddings.projection", "patch_embedding"), ("lambda_1", "ls1"), ("lambda_2", "ls2"),
               ("attention.projection_layer", "attn.proj"), ("attention.", "attn."),
               ("layernorm_before", "norm1"), ("layernorm_after", "norm2"),
               ("model.multi_modal_projector.layer_norm", "mlp1.0"), ("model.multi_modal_projector.linear_1", "mlp1.1"),
               ("model.multi_modal_projector.linear_2", "mlp1.3"), ("model.language_model.", "language_model.model."),
               ("lm_head.", "language_model.lm_head.")]
    for key, tensor in state.items():
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = tensor
    for key in [k for k in out if ".attn.q_proj." in k]:
        parts = [out.pop(key.replace("q_proj", x)) for x in ("q_proj", "k_proj", "v_proj")]
        assert parts[0].shape[0] == hidden
        out[key.replace("q_proj", "qkv")] = torch.cat(parts)
    return out


def _saved(model, path) -> dict[str, torch.Tensor]:
    """The tensors of a model as save_pretrained writes them (transformers' file spelling)."""
    from safetensors.torch import load_file

    model.save_pretrained(path)
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_spelling_maps_to_the_same_weights_and_back(name, tmp_path):
    """Import from transformers' in-memory names, its files' (save_pretrained, the Hub's -hf repos)
    and OpenGVLab's original ones: the same state of our modules; each exports its own spelling back
    bit for bit (no tensor dropped or added)."""
    hf, family, sizes, ours = _imported(name)
    tied = sizes.llm_arch.tied_embeddings
    memory = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and tied)}
    spellings = {"transformers": memory, "hf_files": _saved(hf, tmp_path),
                 "opengvlab": _opengvlab_spelled(memory, sizes)}
    for scheme_name, spelled in spellings.items():
        scheme = family.scheme_of(spelled, sizes)
        assert scheme.name == scheme_name
        states = family.to_ours(spelled, sizes, scheme)
        for module, state in states.items():
            assert state.keys() == ours[module].keys()
            assert all(torch.equal(state[k], ours[module][k]) for k in state), module
        back = family.to_hf(states, sizes, scheme)
        assert back.keys() == spelled.keys()
        assert all(torch.equal(back[k], spelled[k]) for k in back)


def test_sizes_from_the_config():
    _, _, sizes, _ = _imported("internvit6b_qwen3")
    assert (sizes.family, sizes.image_size, sizes.patch_size, sizes.enc_num_attention_heads) == ("internvl", 64, 8, 4)
    assert sizes.family_arch == dict(qkv_bias=False, qk_norm=True, layer_scale_init=0.1, norm_type="rms_norm",
                                     downsample_ratio=0.5, projector_activation="gelu_pytorch_tanh")
    assert sizes.vision_arch.normalization == "RMSNorm" and sizes.vision_arch.class_token
    assert sizes.llm_arch.qk_norm and not sizes.llm_arch.tied_embeddings and sizes.llm_arch.head_dim == 16


@pytest.mark.parametrize("change, match", [
    (dict(vision_feature_layer=-2), "vision_feature_layer = -2"),
    (dict(downsample_ratio=0.3), "downsample_ratio 0.3"),
    (dict(vision_config={**CONFIGS["internvit300m_qwen2"]["vision_config"], "use_mean_pooling": False}),
     "use_mean_pooling = False"),
    (dict(text_config=dict(model_type="gemma", vocab_size=VOCAB)), "text_config.model_type 'gemma'"),
])
def test_unsupported_configs(change, match):
    from transformers import InternVLConfig

    config = InternVLConfig(**{**CONFIGS["internvit300m_qwen2"], **change}, image_token_id=IMAGE_TOKEN)
    with pytest.raises(HFMappingError, match=match):
        family_named("internvl").sizes(config)


def test_unknown_tensor_is_named():
    _, family, sizes, _ = _imported("internvit300m_qwen2")
    state = {k: v for k, v in hf_model("internvit300m_qwen2").state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(HFMappingError, match="vision_model.extra"):
        family.scheme_of([*state, "vision_model.extra"], sizes)
    assert hf_config("internvit300m_qwen2").image_token_id == IMAGE_TOKEN


# ---- images (one process): tiles, pixels and tokens as transformers' InternVLProcessor makes them ----
def _hf_processor(model_dir):
    """transformers' InternVLProcessor of a model directory with the PIL image processor (its
    constructor insists on a video processor, which needs torchvision: none is needed for images)."""
    from unittest import mock

    from transformers import AutoTokenizer, GotOcr2ImageProcessorPil, InternVLProcessor

    with mock.patch("transformers.processing_utils.ProcessorMixin.check_argument_for_proper_class"):
        return InternVLProcessor(image_processor=GotOcr2ImageProcessorPil.from_pretrained(model_dir),
                                 tokenizer=AutoTokenizer.from_pretrained(model_dir), video_processor=None,
                                 image_seq_length=ROWS_PER_TILE)


def test_images_as_transformers_processes_them(tmp_path):
    """Wide, tall, square, tiny and large images: the tile count from the size alone, the pixels of
    the file, and the `<image>` expansion equal InternVLProcessor's (tiles of 64 pixels, at most 6
    and a thumbnail)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig

    from megatron_hetero.data.chat import HFChatTokenizer
    from megatron_hetero.families.internvl.media import build_media, processor_settings

    internvl_dir(tmp_path, "internvit300m_qwen2", max_patches=6)
    config = AutoConfig.from_pretrained(tmp_path)
    sizes = family_named("internvl").sizes(config, ModelSizes(seq_length=SEQ))
    images = build_media(sizes, processor_settings(tmp_path, config), config.to_dict())
    tokens = images.tokens(HFChatTokenizer(str(tmp_path), image_token=False))
    hf = _hf_processor(tmp_path)
    rng = np.random.default_rng(0)
    for width, height in [(200, 60), (60, 200), (64, 64), (10, 7), (500, 450), (130, 64)]:
        path = tmp_path / f"{width}x{height}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        want = hf(images=[Image.open(path)], text=["describe <IMG_CONTEXT> it"], return_tensors="pt")
        items = images.items(width, height)
        assert torch.equal(images.pixels(path), want["pixel_values"]), (width, height)
        assert len(items.rows) == len(want["pixel_values"]) and set(items.rows) == {ROWS_PER_TILE}
        describe, it = (hf.tokenizer.convert_tokens_to_ids(w) for w in ("describe", "it"))
        expanded = [describe, *tokens.prefix, *[tokens.placeholder] * sum(items.rows), *tokens.suffix, it]
        assert want["input_ids"][0].tolist() == expanded, (width, height)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_fused_layer_scale_add_equals_eager(bias):
    """--bias-dropout-fusion's layer-scale bias-dropout-add (torch.compile, as megatron-core's fused
    bias-dropout-add) against the eager one: the output and every gradient (x, bias, residual, scale)."""
    from megatron_hetero.families.internvl.vision import _scaled_bias_dropout_add

    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(9, 2, 16, generator=g), torch.randn(16, generator=g), torch.randn(9, 2, 16, generator=g),
              torch.rand(16, generator=g)]
    dout = torch.randn(9, 2, 16, generator=g)
    assert_compiled_equals_eager(
        lambda fused, x, b, residual, scale: _scaled_bias_dropout_add(scale)(True, fused)(
            (x, b if bias else None), residual, 0.0),
        leaves, dout, tol=1e-6)
