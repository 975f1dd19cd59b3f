"""InternVL from a Hugging Face directory to a trained export (what the README's InternVL section runs):
`python -m megatron_hetero.hf import --model` of a tiny random InternVL directory (tests/internvl_models.py:
an InternViT-6B-like tower with QK-norm over all heads into a Qwen3 with per-head QK-norm; the file
spelling save_pretrained writes, and OpenGVLab's original spelling), `export --out` bit-identical,
`hf compare` within 1e-4, and examples/pretrain_vlm.py training on LLaVA-style conversations (images of
several sizes, a text-only sample, a corrupt and a missing image): 3 steps under vision TP2 -> LLM TP2
equal one process's; that run's checkpoint exports to a directory transformers loads and `hf compare`
finds equal to the checkpoint. Under the `families` marker (make test-families): the layout matrix
(vision DP2 -> LLM CP2 / PP2, non-colocated vision -> LLM TP2, vision DP2 -> LLM PP2 and vision PP2 ->
LLM TP2, vision TP2 DP2 -> LLM TP2 CP2 SP), `hf compare` under vision TP2, vision DP2 -> LLM TP2 SP,
LLM CP2, LLM PP2, non-colocated, non-colocated vision PP2 and that 4-rank layout, a resume under
another layout, the training matrix at micro batch 1.
The helpers are Qwen2.5-VL's tests' (tests/test_qwen2_5_vl.py): the same commands, another family."""

import os

import pytest
import torch
from safetensors.torch import save_file

from tests.distributed import collect_distributed
from tests.internvl_models import SPECIALS, internvl_dir
from tests.test_checkpoint import SCRIPT, at
from tests.test_internvl import _opengvlab_spelled
from tests.test_qwen2_5_vl import (
    MICRO_BATCH_1,
    _cli,
    _compare_args,
    _compare_worker,
    _report,
    _tensors,
    _train_flags,
    assert_same_steps,
    train,
)
from tests.vlm_fixtures import QWEN_TEMPLATE, conversations, word_tokenizer

TOL = 1e-4
LAYOUTS = {
    "single": "placement: colocated\nmodules:\n  vision: {role: encoder}\n  llm: {role: llm}\n",
    "vtp2_ldp2": "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 2}\n  llm: {role: llm, dp: 2}\n",
    "vdp2_ltp2sp": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n"
                   "  llm: {role: llm, tp: 2, sp: true}\n",
    "noncolocated_v1_l1": "placement: non_colocated\nmodules:\n  vision: {role: encoder, ranks: 0-0}\n"
                          "  llm: {role: llm, ranks: 1-1}\n",
    "vtp2_ltp2": "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 2}\n  llm: {role: llm, tp: 2}\n",
    "vdp2_lcp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, cp: 2}\n",
    "vdp2_lpp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, pp: 2}\n",
    "noncolocated_v1_ltp2": "placement: non_colocated\nmodules:\n  vision: {role: encoder, ranks: 0-0}\n"
                            "  llm: {role: llm, tp: 2, ranks: 1-2}\n",
    "vtp2dp2_ltp2cp2sp": "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 2, dp: 2}\n"
                         "  llm: {role: llm, tp: 2, cp: 2, sp: true}\n",
    "noncolocated_vdp2_lpp2": "placement: non_colocated\nmodules:\n  vision: {role: encoder, dp: 2, ranks: 0-1}\n"
                              "  llm: {role: llm, pp: 2, ranks: 2-3}\n",
    "noncolocated_vpp2_ltp2": "placement: non_colocated\nmodules:\n  vision: {role: encoder, pp: 2, ranks: 0-1}\n"
                              "  llm: {role: llm, tp: 2, ranks: 2-3}\n",
    "noncolocated_vpp2_l1": "placement: non_colocated\nmodules:\n  vision: {role: encoder, pp: 2, ranks: 0-1}\n"
                            "  llm: {role: llm, ranks: 2-2}\n",
}
WORLD = {"single": 1, "noncolocated_v1_ltp2": 3, "vtp2dp2_ltp2cp2sp": 4, "noncolocated_vdp2_lpp2": 4,
         "noncolocated_vpp2_ltp2": 4, "noncolocated_vpp2_l1": 3}
# `hf compare` layouts, by world size: on 2 ranks each module's parallelism alone (vision TP2, vision
# DP2 -> LLM TP2 with SP, LLM CP2, LLM PP2, non-colocated); the vision stages (3 ranks); all at once (4).
COMPARED = {2: ["vtp2_ldp2", "vdp2_ltp2sp", "vdp2_lcp2", "vdp2_lpp2", "noncolocated_v1_l1"],
            3: ["noncolocated_vpp2_l1"], 4: ["vtp2dp2_ltp2cp2sp"]}
MATRIX = ["vdp2_lcp2", "vdp2_lpp2", "noncolocated_v1_ltp2", "vtp2dp2_ltp2cp2sp", "noncolocated_vdp2_lpp2",
          "noncolocated_vpp2_ltp2"]


def _ok(result) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    """The model directory, its conversation data, its import and the layout files."""
    tmp = tmp_path_factory.mktemp("internvl")
    internvl_dir(tmp / "hf", "internvit6b_qwen3")
    data = conversations(tmp / "data")
    _ok(_cli("import", "--model", tmp / "hf", "--save", tmp / "ckpt"))
    for name, text in LAYOUTS.items():
        (tmp / f"{name}.yaml").write_text(text)
    return tmp, data


@pytest.fixture(scope="module")
def reference(internvl):
    return train(*internvl, "reference", "single", 1)


@pytest.fixture(scope="module")
def trained(internvl):
    """3 steps colocated vision TP2 -> LLM TP2, saved at steps 2 and 3 (tmp/trained): the metrics."""
    tmp, data = internvl
    return train(tmp, data, "vtp2_ltp2", "vtp2_ltp2", 2, ["--save", str(tmp / "trained"), "--save-interval", "2"])


def test_import_export_is_bit_identical(internvl):
    """The files' tensors, keys and dtypes back as imported (save_pretrained's spelling), beside the
    directory's other files."""
    tmp, _ = internvl
    _ok(_cli("export", "--load", tmp / "ckpt", "--out", tmp / "exported"))
    original, exported = _tensors(tmp / "hf"), _tensors(tmp / "exported")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], t) and exported[k].dtype == t.dtype for k, t in original.items())
    for name in ("tokenizer_config.json", "preprocessor_config.json", "config.json"):
        assert (tmp / "exported" / name).read_bytes() == (tmp / "hf" / name).read_bytes()


def test_opengvlab_spelling_imports_and_exports_back(internvl, tmp_path):
    """A directory whose files use OpenGVLab's original names (vision_model.*, fused attn.qkv, mlp1.*,
    language_model.model.*): the import holds the same weights; the export writes those names back."""
    from transformers import AutoConfig, InternVLForConditionalGeneration

    from megatron_hetero.families import family_named

    tmp, _ = internvl
    hub = tmp_path / "hub"
    hub.mkdir()
    for path in (tmp / "hf").iterdir():
        if path.suffix != ".safetensors":
            (hub / path.name).write_bytes(path.read_bytes())
    sizes = family_named("internvl").sizes(AutoConfig.from_pretrained(tmp / "hf"))
    memory = InternVLForConditionalGeneration.from_pretrained(tmp / "hf").state_dict()  # untied: lm_head too
    spelled = {k: t.contiguous() for k, t in _opengvlab_spelled(memory, sizes).items()}
    save_file(spelled, hub / "model.safetensors", metadata={"format": "pt"})
    _ok(_cli("import", "--model", hub, "--save", tmp_path / "ckpt"))
    _ok(_cli("export", "--load", tmp_path / "ckpt", "--out", tmp_path / "out"))
    exported = _tensors(tmp_path / "out")
    assert exported.keys() == spelled.keys()
    assert all(torch.equal(exported[k], t) for k, t in spelled.items())


def test_tied_bf16_round_trip_loads_in_transformers(tmp_path):
    """The InternViT-300M-like tower into a Qwen2 with tied embeddings, saved in bf16 with the tied
    lm_head as a copy of the embedding in its files: import -> export gives every tensor back bit for
    bit (keys, dtypes, the copy), beside the tokenizer, chat template and processor files; transformers
    loads the export and computes what the original does. A copy that differs: one line, nothing written."""
    from transformers import InternVLForConditionalGeneration

    src = internvl_dir(tmp_path / "hf", "internvit300m_qwen2")
    InternVLForConditionalGeneration.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(src)
    tensors = _tensors(src)  # save_pretrained's spelling: language_model.model.*, language_model.lm_head
    tensors["language_model.lm_head.weight"] = tensors["language_model.model.embed_tokens.weight"].clone()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    _ok(_cli("import", "--model", src, "--save", tmp_path / "ckpt"))
    _ok(_cli("export", "--load", tmp_path / "ckpt", "--out", tmp_path / "out"))
    exported = _tensors(tmp_path / "out")
    assert exported.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert exported[key].dtype == tensor.dtype == torch.bfloat16 and torch.equal(exported[key], tensor), key
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes(), name
    a, b = (InternVLForConditionalGeneration.from_pretrained(d, dtype=torch.float32) for d in (src, tmp_path / "out"))
    ids = torch.arange(5, 25)[None]
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    # a copy that is no copy: one line, nothing written (never dropped silently)
    save_file({**tensors, "language_model.lm_head.weight": torch.zeros_like(tensors["language_model.lm_head.weight"])},
              src / "model.safetensors", metadata={"format": "pt"})
    result = _cli("import", "--model", src, "--save", tmp_path / "bad")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "language_model.lm_head.weight differs from language_model.model.embed_tokens.weight" in result.stderr
    assert not (tmp_path / "bad" / "release").exists()


@pytest.mark.parametrize("case", ["heads", "tokenizer", "vision_cp"])
def test_bad_input_is_one_line(internvl, tmp_path, case):
    """A vision tp that does not divide InternViT's heads (4 here; InternViT-6B has 25), a tokenizer
    without InternVL's image tags, vision CP (InternViT does not split a tile): one line before any
    process group, exit 2."""
    from tests.distributed import run_python

    tmp, data = internvl
    layout = "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 3}\n  llm: {role: llm, dp: 3}\n"
    flags, world = _train_flags(tmp, data), 3
    expected = ("model.json's enc_num_attention_heads 4 is not divisible by module vision's tp=3; set the module's "
                "tp: to a divisor of 4 (1, 2, 4)")
    if case == "tokenizer":
        layout, world = LAYOUTS["vtp2_ltp2"], 2
        word_tokenizer(tmp_path / "tok", [t for t in SPECIALS if t != "<img>"], QWEN_TEMPLATE, eos="<|im_end|>",
                       pad="<|endoftext|>")
        flags += ["--tokenizer-model", str(tmp_path / "tok")]
        expected = "tok has no <img> token; use the InternVL model's own tokenizer"
    if case == "vision_cp":
        layout = "placement: colocated\nmodules:\n  vision: {role: encoder, cp: 2}\n  llm: {role: llm, tp: 2}\n"
        world, expected = 2, ("module vision: cp=2 splits each item's tokens over cp ranks, which this model's "
                              "vision encoder does not; set cp: 1 and use dp for its ranks, or cp_replicated: true")
    (tmp_path / "layout.yaml").write_text(layout)
    env = dict(os.environ, WORLD_SIZE=str(world), RANK="0", PYTHONWARNINGS="ignore")
    result = run_python([SCRIPT, "--hetero-layout", "layout.yaml", *flags], env=env, cwd=tmp_path, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert expected in lines[0], lines[0]


def test_compare_on_one_process(internvl):
    """5 samples (tiles of images of several sizes, two images in one, a text-only sample): our
    logits within 1e-4 of transformers'; the corrupt and missing images skipped."""
    per_sample, worst = _report(_ok(_cli(*_compare_args(*internvl))))
    assert len(per_sample) == 5 and worst <= TOL


def test_training_under_vision_tp2_llm_tp2_equals_one_process_and_exports(internvl, reference, trained):
    """3 steps colocated vision TP2 -> LLM TP2 (InternViT's QK-norm over heads split over TP, Qwen3's
    per-head QK-norm) equal one process's; the checkpoint exports to a directory transformers loads,
    which `hf compare` finds equal to the checkpoint."""
    from transformers import InternVLForConditionalGeneration

    tmp, data = internvl
    assert_same_steps(reference, trained)
    out = tmp / "trained_hf"
    _ok(_cli("export", "--load", tmp / "trained", "--out", out))
    InternVLForConditionalGeneration.from_pretrained(out)
    exported, original = _tensors(out), _tensors(tmp / "hf")
    assert exported.keys() == original.keys()
    key = "multi_modal_projector.linear_1.weight"
    assert not torch.equal(exported[key], original[key])  # it trained
    args = _compare_args(tmp, data)
    args[args.index("--model") + 1], args[args.index("--load") + 1] = str(out), str(tmp / "trained")
    assert _report(_ok(_cli(*args)))[1] <= TOL


@pytest.mark.families
@pytest.mark.parametrize("layout", MATRIX)
def test_training_matrix(internvl, reference, layout):
    assert_same_steps(reference, train(*internvl, layout, layout, WORLD.get(layout, 2)))


@pytest.fixture(scope="module")
def reference_micro_batch_1(internvl):
    return train(*internvl, "reference_mbs1", "single", 1, MICRO_BATCH_1)


@pytest.mark.families
@pytest.mark.parametrize("layout", ["vtp2_ltp2", "vdp2_ltp2sp", *MATRIX])
def test_micro_batch_1_matrix(internvl, reference_micro_batch_1, layout):
    """Micro batch 1 under every layout of the matrix, vision TP2 -> LLM TP2 without SP and vision DP2
    -> LLM TP2 with SP too: 3 steps equal one process's."""
    got = train(*internvl, f"{layout}_mbs1", layout, WORLD.get(layout, 2), MICRO_BATCH_1)
    assert_same_steps(reference_micro_batch_1, got)


@pytest.mark.families
def test_checkpoint_resumes_under_another_layout(internvl, trained):
    """Saved at step 2 under vision TP2 -> LLM TP2, resumed for step 3 under vision DP2 -> LLM PP2:
    step 3 equals the uninterrupted run's within 1e-5."""
    tmp, data = internvl
    resumed = train(tmp, data, "resumed", "vdp2_lpp2", 2, ["--load", str(at(tmp / "trained", 2, "vdp2_lpp2"))])
    assert_same_steps(trained, resumed, rel=1e-5, first=3)


@pytest.mark.families
@pytest.mark.parametrize("world", sorted(COMPARED))
def test_compare_under_layouts(internvl, tmp_path, world):
    """`hf compare --hetero-layout` (logits gathered over the LLM's TP, CP and PP) within 1e-4 of
    transformers' on every sample, under every layout of COMPARED: each module's parallelism alone,
    both placements, InternViT over two pipeline stages, and vision TP2 DP2 -> LLM TP2 CP2 SP."""
    tmp, data = internvl
    rank0 = collect_distributed(_compare_worker, world, tmp_path, str(tmp), str(data), COMPARED[world])[0]
    for name, (code, text) in rank0.items():
        per_sample, worst = _report(text)
        assert code == 0 and len(per_sample) == 5 and worst <= TOL, (name, text[-2000:])
