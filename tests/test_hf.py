"""Hugging Face weights (megatron_hetero/hf): tiny random transformers models (Llama, Qwen2 with tied
and untied embeddings, Qwen3 with its QK-norm, SigLIP and CLIP vision towers) imported into our modules reproduce
transformers' hidden states and logits within 1e-5 (fp32) on one rank and under TP2, PP2 and CP2
layouts (2 gloo processes, one launch for every case); import -> export gives the Hugging Face
files back bit for bit, and transformers loads an export with equal outputs."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    CLIPConfig,
    CLIPModel,
    CLIPVisionConfig,
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SiglipVisionConfig,
    SiglipVisionModel,
)

from megatron_hetero.convert.rules import FusedQKV
from megatron_hetero.data.images import NORMALIZATION
from megatron_hetero.hf import FAMILIES, HFMappingError, export_hf, family_of, import_hf, load_full_tensors
from megatron_hetero.models.full_state import FullStateError, tp_part, tp_whole
from megatron_hetero.spec.sizes import ModelSizes
from tests.distributed import collect_distributed

SEQ, BATCH, VOCAB, IMAGE = 16, 2, 100, 32
TOL = 1e-5
_LLM = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB)
_VISION = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE,
               patch_size=8)
# name -> the transformers model (random weights drawn in _hf_model); the Llama and the Qwen3 have a
# head size other than hidden / heads, a RoPE theta other than the default, and a vocabulary we pad.
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_LLM, head_dim=32,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    "qwen2_tied": lambda: Qwen2ForCausalLM(Qwen2Config(**_LLM, tie_word_embeddings=True)),
    "qwen2_untied": lambda: Qwen2ForCausalLM(Qwen2Config(**_LLM, tie_word_embeddings=False)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_LLM, head_dim=32, tie_word_embeddings=True,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "siglip": lambda: SiglipVisionModel(SiglipVisionConfig(**_VISION, vision_use_head=False)),
    "clip": lambda: CLIPVisionModel(CLIPVisionConfig(**_VISION)),
    # Files with tensors our encoder does not hold (carried from import to export unchanged):
    # SigLIP's attention-pooling head (transformers' default), CLIP's projection beside the tower.
    "siglip_head": lambda: SiglipVisionModel(SiglipVisionConfig(**_VISION)),
    "clip_projection": lambda: CLIPVisionModelWithProjection(CLIPVisionConfig(**_VISION, projection_dim=16)),
}
SIGLIP_FAMILY = FAMILIES["siglip_vision_model"]
LLMS = ("llama", "qwen2_tied", "qwen2_untied", "qwen3")
WITH_UNTRAINED = ("siglip_head", "clip_projection")  # the same towers as siglip's and clip's
# layout -> ModuleLayout sizes on 2 ranks ("one_rank": each rank a whole model, dp 2); encoders have no CP.
LAYOUTS = {"one_rank": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2), "cp2": dict(cp=2)}
CASES = [(m, lay) for m in MODELS for lay in LAYOUTS if (m in LLMS or lay != "cp2") and m not in WITH_UNTRAINED]


@torch.no_grad()
def _hf_model(name: str):
    """The model with every weight random (transformers initializes norms to 1 and biases to 0,
    which would hide a misplaced norm or bias): matrices ~ N(0, 1/fan_in), norm weights 1 + N(0, 0.1^2),
    other vectors N(0, 0.1^2)."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    gen = torch.Generator().manual_seed(1)
    for pname, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() > 1:
            p.copy_(noise * p[0].numel() ** -0.5)
        else:
            p.copy_(("norm" in pname and pname.endswith("weight")) + 0.1 * noise)
    return model


def _inputs(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    if name in LLMS:
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)


@torch.no_grad()
def _hf_outputs(name: str, model, x) -> dict[str, torch.Tensor]:
    """What ours must reproduce, [b, s, ...]: the last hidden states (after the final norm) and the
    logits; for CLIP every token through the post-layernorm, and its pooled class token."""
    if name in LLMS:
        return {"hidden": model.model(x).last_hidden_state, "logits": model(x).logits}
    out = model(x)
    if name == "siglip":
        return {"hidden": out.last_hidden_state}
    if name == "siglip_head":
        return {"hidden": out.last_hidden_state, "pooled": out.pooler_output}
    if name == "clip_projection":
        return {"hidden": out.last_hidden_state, "projected": out.image_embeds}
    return {"hidden": model.post_layernorm(out.last_hidden_state), "pooled": out.pooler_output}


# ---- distributed: every (model, layout) pair in one launch of 2 processes --------------------------
def _run_stages(module, pgs, first_input, forward, hidden_shape):
    """Run this rank's pipeline stage: forward(module, x) on first_input on the first stage, on the
    previous stage's output on later ones; the output of the last stage (None elsewhere)."""
    pp_rank, pp = pgs.pp.rank(), pgs.pp.size()
    ranks = dist.get_process_group_ranks(pgs.pp)
    x = first_input
    if pp_rank > 0:
        x = torch.empty(hidden_shape)
        dist.recv(x, ranks[pp_rank - 1])
    out = forward(module, x)
    if pp_rank < pp - 1:
        dist.send(out.contiguous(), ranks[pp_rank + 1])
        return None
    return out


@torch.no_grad()
def _case_pairs(name: str, layout: str, pgs) -> dict:
    from megatron_hetero.models.context_parallel import cp_positions
    from megatron_hetero.models.vlm import build_llm, build_vision_encoder, llm_forward

    hf = _hf_model(name)
    x = _inputs(name)
    want = _hf_outputs(name, hf, x)
    family, config = family_of(hf.config)
    sizes = family.sizes(config, ModelSizes(seq_length=SEQ))
    build = build_llm if family.module == "llm" else build_vision_encoder
    module = build(sizes, pgs.tp.size(), pgs).eval()
    load_full_tensors(module, family.to_ours(hf.state_dict(), sizes), pgs.tp, allow_missing=family.ours_only)

    if family.module == "vision":
        tokens = want["hidden"].shape[1]
        out = _run_stages(module, pgs, x, lambda m, h: m.encode(h), (tokens, BATCH, sizes.enc_hidden_size))
        if out is None:
            return {}
        got = out.transpose(0, 1)
        pairs = {"hidden": (got, want["hidden"])}
        if "pooled" in want:
            pairs["pooled"] = (got[:, 0], want["pooled"])
        return pairs

    positions = cp_positions(SEQ, pgs.cp.size(), pgs.cp.rank())
    captured = {}
    module.decoder.register_forward_hook(lambda m, i, out: captured.update(hidden=out))

    def forward(llm, hidden):
        ids = x[:, positions]
        if llm.pre_process:
            return llm_forward(llm, ids, positions[None].expand(BATCH, -1), [])
        return llm_forward(llm, ids, positions[None].expand(BATCH, -1), [], hidden=hidden)

    logits = _run_stages(module, pgs, None, forward, (len(positions), BATCH, sizes.hidden_size))
    if logits is None:
        return {}
    return {"hidden": (captured["hidden"].transpose(0, 1), want["hidden"][:, positions]),
            "logits": (logits[..., :VOCAB], want["logits"][:, positions])}


def _worker(rank, world_size):
    from megatron_hetero.parallel.groups import build_module_groups
    from megatron_hetero.parallel.parallel_state import init_outside_training
    from megatron_hetero.patches import cpu
    from megatron_hetero.spec.layout import ModuleLayout

    cpu.apply()
    init_outside_training(0, tp_rank=0)
    results = {}
    for name, layout in CASES:
        role = "llm" if name in LLMS else "encoder"
        pgs = build_module_groups(ModuleLayout(f"{name}_{layout}", role, **LAYOUTS[layout])).pgs
        results[f"{name}/{layout}"] = _case_pairs(name, layout, pgs)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return collect_distributed(_worker, 2, tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("name, layout", CASES)
def test_imported_module_reproduces_transformers(runs, name, layout):
    """Hidden states and logits (on the ranks that hold the last stage) within 1e-5 of transformers'."""
    pairs = [p for rank_results in runs for p in rank_results[f"{name}/{layout}"].items()]
    assert pairs
    for output, (got, want) in pairs:
        assert got.shape == want.shape, output
        diff = (got - want).abs().max().item()
        print(f"{name} {layout} {output}: max |ours - transformers| = {diff:.2e} (scale {want.abs().max():.2f})")
        assert diff <= TOL, f"{output}: {diff}"


# ---- import -> export, and transformers loading exports (one process) ------------------------------
def _saved(model, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a model as save_pretrained writes them."""
    model.save_pretrained(path)
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("name", MODELS)
def test_import_export_round_trip_is_bit_identical(tmp_path, name):
    model = _hf_model(name)
    original = _saved(model, tmp_path / "hf")
    imported = import_hf(tmp_path / "hf")
    assert imported.family is family_of(model.config)[0]
    export_hf(tmp_path / "out", imported.family, imported.sizes, imported.state, imported.config,
              imported.untrained, imported.prefix, imported.processor)
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


@pytest.mark.parametrize("name, with_base_config", [(m, True) for m in MODELS] + [("llama", False), ("clip", False)])
def test_transformers_loads_an_export(tmp_path, name, with_base_config):
    """The exported directory, with the imported config as base or from our sizes alone."""
    model = _hf_model(name)
    family, config = family_of(model.config)
    sizes = family.sizes(config)
    state = model.state_dict()
    export_hf(tmp_path, family, sizes, family.to_ours(state, sizes), config if with_base_config else None,
              family.untrained(state), family.prefix(state))
    auto = AutoModelForCausalLM if name in LLMS else type(model) if name == "clip_projection" else AutoModel
    loaded = auto.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    x = _inputs(name)
    for key, want in _hf_outputs(name, model, x).items():
        assert torch.equal(_hf_outputs(name, loaded, x)[key], want), key


def test_tensors_the_encoder_does_not_hold_come_back():
    """SigLIP's pooling head and CLIP's projection are not our encoder's: an import carries them (and
    the file's key prefix) to the export, which writes them unchanged with the head still in the
    config (round trip and transformers' outputs: the tests above)."""
    for name, kept in (("siglip_head", "head."), ("clip_projection", "visual_projection.")):
        state = _hf_model(name).state_dict()
        family, config = family_of(_hf_model(name).config)
        untrained = family.untrained(state)
        assert untrained and untrained.keys() == {k for k in state if k.startswith(kept)}, name
    config = family_of(_hf_model("siglip_head").config)[1]
    assert SIGLIP_FAMILY.config(SIGLIP_FAMILY.sizes(config), config).vision_use_head is True


def test_image_processor_normalization_is_recorded(tmp_path):
    """A vision tower's pixel normalization is its image processor's (preprocessor_config.json),
    else transformers' default for the family; export writes the processor back."""
    from transformers import SiglipImageProcessor

    model = _hf_model("siglip")
    model.save_pretrained(tmp_path / "default")
    assert import_hf(tmp_path / "default").sizes.vision_arch.pixel_normalization == NORMALIZATION["siglip"]
    model.save_pretrained(tmp_path / "own")
    SiglipImageProcessor(image_mean=[0.1, 0.2, 0.3], image_std=[0.4, 0.5, 0.6]).save_pretrained(tmp_path / "own")
    imported = import_hf(tmp_path / "own")
    assert imported.sizes.vision_arch.pixel_normalization == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    export_hf(tmp_path / "out", imported.family, imported.sizes, imported.state, imported.config,
              imported.untrained, imported.prefix, imported.processor)
    assert list(SiglipImageProcessor.from_pretrained(tmp_path / "out").image_mean) == [0.1, 0.2, 0.3]


def test_vision_tower_of_a_clip_checkpoint(tmp_path):
    """A text + vision CLIP checkpoint (what VLMs start from): its vision tower is imported."""
    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=50)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=_VISION)).eval()
    model.save_pretrained(tmp_path / "clip")
    imported = import_hf(tmp_path / "clip")
    assert imported.family is FAMILIES["clip_vision_model"]
    export_hf(tmp_path / "tower", imported.family, imported.sizes, imported.state, imported.config)
    tower = AutoModel.from_pretrained(tmp_path / "tower").eval()
    x = _inputs("clip")
    assert torch.equal(tower(x).last_hidden_state, model.vision_model(x).last_hidden_state)


@pytest.mark.parametrize("name", MODELS)
def test_config_round_trip(name):
    family, config = family_of(_hf_model(name).config)
    sizes = family.sizes(config, ModelSizes(seq_length=SEQ))
    assert family.sizes(family.config(sizes), ModelSizes(seq_length=SEQ)) == sizes


# ---- the pieces --------------------------------------------------------------------------------------
def test_fused_qkv_is_interleaved_per_query_group():
    """4 query heads in 2 groups, head size 1: [q0 q1 k0 v0 | q2 q3 k1 v1]; and back."""
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    rule = FusedQKV("qkv", ("q", "k", "v"), heads=4, groups=2)
    fused = rule.join(q, k, v)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(rule.split(fused), (q, k, v)))


def test_tp_parts_of_a_gated_fc1():
    """Stride 2 (megatron-core's gated fc1): rank r holds [gate_r; up_r]; the parts make the whole."""
    gate, up = torch.arange(4.0), torch.arange(10.0, 14)
    whole = torch.cat([gate, up])
    parts = [tp_part(whole, 0, 2, 2, r) for r in range(2)]
    assert parts[1].tolist() == [2, 3, 12, 13]
    assert torch.equal(tp_whole(parts, 0, 2), whole)


def test_load_full_tensors_errors():
    linear = torch.nn.Linear(2, 3)
    with pytest.raises(FullStateError, match="bias is missing"):
        load_full_tensors(linear, {"weight": torch.zeros(3, 2)}, None)
    with pytest.raises(FullStateError, match=r"weight: this rank's part is \(2, 2\)"):
        load_full_tensors(linear, {"weight": torch.zeros(2, 2), "bias": torch.zeros(3)}, None)
    load_full_tensors(linear, {"weight": torch.ones(3, 2)}, None, allow_missing=("bias",))
    assert torch.equal(linear.weight, torch.ones(3, 2))


@pytest.mark.parametrize("config, match", [
    (LlamaConfig(**_LLM, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "rope_parameters.rope_type = 'linear'"),
    (LlamaConfig(**_LLM, attention_bias=True), "attention_bias = True"),
    (LlamaConfig(**_LLM, hidden_act="relu"), "hidden_act = 'relu'"),
    (Qwen2Config(**_LLM, use_sliding_window=True), "use_sliding_window = True"),
    (Qwen3Config(**_LLM, attention_bias=True), "attention_bias = True"),
])
def test_unsupported_configs(config, match):
    family, config = family_of(config)
    with pytest.raises(HFMappingError, match=match):
        family.sizes(config)


def test_unsupported_family_and_keys():
    from transformers import GPT2Config

    with pytest.raises(HFMappingError, match="model_type 'gpt2' is not supported"):
        family_of(GPT2Config())
    model = _hf_model("qwen2_untied")
    family, config = family_of(model.config)
    sizes = family.sizes(config)
    state = model.state_dict()
    with pytest.raises(HFMappingError, match="model.layers.1.mlp.up_proj.weight is missing"):
        family.to_ours({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}, sizes)
    with pytest.raises(HFMappingError, match="model.extra.weight .* has no counterpart"):
        family.to_ours({**state, "model.extra.weight": torch.zeros(1)}, sizes)
    tied = _hf_model("qwen2_tied")
    family, config = family_of(tied.config)
    state = {**tied.state_dict(), "lm_head.weight": torch.zeros_like(tied.lm_head.weight)}
    with pytest.raises(HFMappingError, match="lm_head.weight differs from model.embed_tokens.weight"):
        family.to_ours(state, family.sizes(config))
