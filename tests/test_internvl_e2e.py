"""InternVL from a Hugging Face directory to a trained export (what the README's InternVL section runs):
`python -m megatron_hetero.hf import --model` of a tiny random InternVL directory (tests/internvl_models.py,
in the file spelling save_pretrained writes, and in OpenGVLab's original spelling), `export --out`
bit-identical, `hf compare` within 1e-4, and examples/pretrain_vlm.py training on its LLaVA-style
conversations (images of several sizes, a text-only sample, a corrupt and a missing image): 3 steps
under vision TP2 -> LLM TP2 on 2 processes equal one process's; the trained checkpoint exports to a
directory transformers loads and `hf compare` finds equal to the checkpoint.

The whole layout matrix (vision TP2/DP2, LLM TP2/CP2/PP2, both placements) runs under the pytest
marker `families` (make test-families)."""

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.distributed import run_python
from tests.internvl_models import internvl_dir
from tests.test_checkpoint import EXTRA_LAYOUTS, run
from tests.test_internvl import _opengvlab_spelled
from tests.vlm_fixtures import conversations

SEQ = 192
LAYOUTS = {  # name -> layout file text (the single-process reference: examples/layouts/single.yaml)
    "w2_vtp2_ltp2": "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 2}\n  llm: {role: llm, tp: 2}\n",
    "w2_vdp2_lcp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, cp: 2}\n",
    "w2_vdp2_lpp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, pp: 2}\n",
    "w3_v1_ltp2": "placement: non_colocated\nmodules:\n  vision: {role: encoder, ranks: 0-0}\n"
                  "  llm: {role: llm, tp: 2, ranks: 1-2}\n",
    "w4_vtp2dp2_ltp2cp2": "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 2, dp: 2}\n"
                          "  llm: {role: llm, tp: 2, cp: 2, sp: true}\n",
    "w4_vdp2_lpp2": "placement: non_colocated\nmodules:\n  vision: {role: encoder, dp: 2, ranks: 0-1}\n"
                    "  llm: {role: llm, pp: 2, ranks: 2-3}\n",
}
MATRIX = [name for name in LAYOUTS if name != "w2_vtp2_ltp2"]


def _cli(*args) -> subprocess.CompletedProcess:
    return run_python(["-m", "megatron_hetero.hf", *map(str, args)])


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The InternViT-6B-like model (QK-norms in both modules) as an HF directory, its data, its import."""
    tmp = tmp_path_factory.mktemp("internvl")
    internvl_dir(tmp / "hf", "internvit6b_qwen3")
    conversations(tmp / "data")
    _ok(_cli("import", "--model", tmp / "hf", "--save", tmp / "ckpt"))
    return tmp


def _flags(tmp: Path, load: Path) -> list[str]:
    return ["--load", str(load), "--model-sizes", str(tmp / "ckpt" / "model.json"),
            "--data-path", str(tmp / "data" / "conversations.json"), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tmp / "hf"), "--seq-length", str(SEQ), "--train-iters", "3",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--save-interval", "3"]


@pytest.fixture(scope="module")
def reference(imported):
    """The single-process run: 3 steps' metrics."""
    return run(imported, "one", "single", 1, _flags(imported, imported / "ckpt"))


def _train_under(imported, name: str, flags=(), tag: str = "") -> dict:
    EXTRA_LAYOUTS.setdefault(name, LAYOUTS[name])
    world = int(name.split("_")[0][1:])
    return run(imported, tag + name, name, world, [*_flags(imported, imported / "ckpt"), *flags])


def _assert_same_steps(got: dict, want: dict, steps=(1, 2, 3)):
    assert sorted(got) == sorted(want) == list(steps)
    for step in want:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4), (step, key)


def test_import_export_is_bit_identical(imported):
    """The files' tensors, keys and dtypes back as imported, beside the directory's other files."""
    _ok(_cli("export", "--load", imported / "ckpt", "--out", imported / "exported"))
    original, exported = _tensors(imported / "hf"), _tensors(imported / "exported")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], t) and exported[k].dtype == t.dtype for k, t in original.items())
    for name in ("tokenizer_config.json", "preprocessor_config.json", "config.json"):
        assert (imported / "exported" / name).read_bytes() == (imported / "hf" / name).read_bytes()


def test_opengvlab_spelling_imports_and_exports_back(imported, tmp_path):
    """A directory whose files use OpenGVLab's original names (vision_model.*, fused attn.qkv, mlp1.*,
    language_model.model.*): the import holds the same weights; the export writes those names back."""
    from transformers import AutoConfig, InternVLForConditionalGeneration

    from megatron_hetero.families import family_named

    hub = tmp_path / "hub"
    hub.mkdir()
    for path in (imported / "hf").iterdir():
        if path.suffix != ".safetensors":
            (hub / path.name).write_bytes(path.read_bytes())
    sizes = family_named("internvl").sizes(AutoConfig.from_pretrained(imported / "hf"))
    memory = InternVLForConditionalGeneration.from_pretrained(imported / "hf").state_dict()  # untied: lm_head too
    spelled = {k: t.contiguous() for k, t in _opengvlab_spelled(memory, sizes).items()}
    save_file(spelled, hub / "model.safetensors", metadata={"format": "pt"})
    _ok(_cli("import", "--model", hub, "--save", tmp_path / "ckpt"))
    _ok(_cli("export", "--load", tmp_path / "ckpt", "--out", tmp_path / "out"))
    exported = _tensors(tmp_path / "out")
    assert exported.keys() == spelled.keys()
    assert all(torch.equal(exported[k], t) for k, t in spelled.items())
    _ok(_cli("export", "--load", imported / "ckpt", "--out", tmp_path / "from_hf"))  # the same weights either way
    assert _tensors(tmp_path / "from_hf").keys() == _tensors(imported / "hf").keys()


@pytest.mark.parametrize("case", ["heads", "tokenizer"])
def test_bad_input_is_one_line(imported, tmp_path, case):
    """A vision tp that does not divide InternViT's heads (4 here; InternViT-6B has 25), a tokenizer
    without InternVL's image tags: one line before any process group, exit 2."""
    import os

    from tests.internvl_models import SPECIALS
    from tests.test_checkpoint import SCRIPT
    from tests.vlm_fixtures import QWEN_TEMPLATE, word_tokenizer

    layout = "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 3}\n  llm: {role: llm, dp: 3}\n"
    flags, world = _flags(imported, imported / "ckpt"), 3
    expected = "attention heads 4 is not divisible by module vision's tp=3; set the module's tp: to a divisor of 4 " \
               "(1, 2, 4)"
    if case == "tokenizer":
        layout, world = (LAYOUTS["w2_vtp2_ltp2"], 2)
        word_tokenizer(tmp_path / "tok", [t for t in SPECIALS if t != "<img>"], QWEN_TEMPLATE, eos="<|im_end|>",
                       pad="<|endoftext|>")
        flags += ["--tokenizer-model", str(tmp_path / "tok")]
        expected = "tok has no <img> token; use the InternVL model's own tokenizer"
    (tmp_path / "layout.yaml").write_text(layout)
    env = dict(os.environ, WORLD_SIZE=str(world), RANK="0", PYTHONWARNINGS="ignore")
    result = run_python([SCRIPT, "--hetero-layout", "layout.yaml", *flags], env=env, cwd=tmp_path, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def test_compare_on_one_process(imported):
    out = _ok(_cli("compare", "--model", imported / "hf", "--load", imported / "ckpt", "--data-path",
                   imported / "data" / "conversations.json", "--seq-length", SEQ))
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("max |logit diff|") and "over 5 samples" in summary, out[-2000:]
    assert float(summary.split()[3]) <= 1e-4


@pytest.fixture(scope="module")
def trained(imported):
    """3 steps colocated vision TP2 -> LLM TP2, saved at step 3 in imported/trained: the metrics."""
    return _train_under(imported, "w2_vtp2_ltp2", ["--save", str(imported / "trained")])


def test_training_under_vision_tp2_llm_tp2_equals_one_process_and_exports(imported, reference, trained):
    """3 steps colocated vision TP2 -> LLM TP2 (QK-norm over the ViT's heads split over TP, the
    Qwen3's per-head QK-norm) equal one process's; its checkpoint exports to a directory
    transformers loads, which `hf compare` finds equal to the checkpoint."""
    from transformers import InternVLForConditionalGeneration

    _assert_same_steps(trained, reference)
    out = imported / "trained_hf"
    _ok(_cli("export", "--load", imported / "trained", "--out", out))
    InternVLForConditionalGeneration.from_pretrained(out)
    trained, original = _tensors(out), _tensors(imported / "hf")
    assert trained.keys() == original.keys()
    assert not torch.equal(trained["multi_modal_projector.linear_1.weight"],
                           original["multi_modal_projector.linear_1.weight"])  # it trained
    summary = _ok(_cli("compare", "--model", out, "--load", imported / "trained", "--data-path",
                       imported / "data" / "conversations.json", "--seq-length", SEQ)).strip().splitlines()[-1]
    assert float(summary.split()[3]) <= 1e-4, summary


@pytest.mark.families
@pytest.mark.parametrize("name", MATRIX)
def test_training_matrix(imported, reference, name):
    _assert_same_steps(_train_under(imported, name), reference)


@pytest.mark.families
def test_checkpoint_resumes_under_another_layout(imported, trained):
    """The vision TP2 -> LLM TP2 checkpoint of step 3, continued for 3 steps under vision DP2 -> LLM PP2,
    equals one process continuing it."""
    flags = ["--load", str(imported / "trained"), "--train-iters", "6", "--override-opt_param-scheduler"]
    one = run(imported, "resumed_one", "single", 1, [*_flags(imported, imported / "ckpt"), *flags])
    _assert_same_steps(_train_under(imported, "w2_vdp2_lpp2", flags, tag="resumed_"), one, steps=(4, 5, 6))


def _compare_worker(rank, world_size, argv):
    import contextlib
    import io

    from megatron_hetero.hf.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


@pytest.mark.families
def test_compare_under_a_layout(imported):
    """`hf compare --hetero-layout` with vision TP2 DP2 -> LLM TP2 CP2 SP: logits gathered over the
    LLM's TP and CP, within 1e-4 of transformers'."""
    from tests.distributed import collect_distributed

    layout = imported / "compare_layout.yaml"
    layout.write_text(LAYOUTS["w4_vtp2dp2_ltp2cp2"])
    argv = ["compare", "--model", str(imported / "hf"), "--load", str(imported / "ckpt"), "--data-path",
            str(imported / "data" / "conversations.json"), "--seq-length", str(SEQ), "--hetero-layout", str(layout)]
    (imported / "compare_out").mkdir()
    results = collect_distributed(_compare_worker, 4, imported / "compare_out", argv)
    assert [code for code, _ in results] == [0] * 4, results[0][1][-2000:]
    summary = results[0][1].strip().splitlines()[-1]
    assert summary.startswith("max |logit diff|") and float(summary.split()[3]) <= 1e-4, summary
