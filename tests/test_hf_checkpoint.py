"""`python -m megatron_hetero.hf import / export` through Megatron checkpoints: tiny random
Hugging Face models (tests/test_hf.py's; the SigLIP tower with its pooling head, which our encoder
does not hold, and an image processor) imported into a checkpoint, exported back bit for bit; the
import trains under any layout (the first steps under vision DP2 -> LLM TP2 on 2 processes equal one
process's), its images normalized as its image processor says; a checkpoint saved by that 2-process
run exports to directories transformers loads, with the untrained head as imported."""

import json
import subprocess
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import SiglipImageProcessor

from megatron_hetero.data.images import NORMALIZATION
from megatron_hetero.spec.sizes import sizes_from_dict
from megatron_hetero.training.args import image_normalization
from tests.distributed import run_python
from tests.test_checkpoint import _one_process, run
from tests.test_hf import _hf_model

LLM, VISION = "llama", "siglip_head"


def _cli(*args) -> subprocess.CompletedProcess:
    return run_python(["-m", "megatron_hetero.hf", *args])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_ckpt")
    _hf_model(LLM).save_pretrained(tmp / "llm")
    _hf_model(VISION).save_pretrained(tmp / "vision")
    SiglipImageProcessor().save_pretrained(tmp / "vision")
    result = _cli("import", "--vision", tmp / "vision", "--llm", tmp / "llm", "--save", tmp / "ckpt")
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_import_then_export_is_bit_identical(imported):
    out = imported / "exported"
    result = _cli("export", "--load", imported / "ckpt", "--vision-out", out / "vision", "--llm-out", out / "llm")
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("vision", "llm"):
        original, exported = _tensors(imported / name), _tensors(out / name)
        assert exported.keys() == original.keys(), name
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), (name, key)
    processor = [json.loads((d / "vision" / "preprocessor_config.json").read_text()) for d in (out, imported)]
    assert processor[0] == processor[1]


def test_import_trains_under_any_layout_and_exports(imported):
    """The same first steps from the import under one process and under vision DP2 -> LLM TP2;
    the 2-process run's checkpoint exports to directories transformers loads."""
    from transformers import AutoModel, AutoModelForCausalLM

    flags = ["--load", str(imported / "ckpt"), "--model-sizes", str(imported / "ckpt" / "model.json"),
             "--train-iters", "3", "--save-interval", "3"]
    one = run(imported, "one", "single", 1, flags)
    two = run(imported, "two", "w2_vdp2_ltp2", 2, [*flags, "--save", str(imported / "trained")])
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in one:
        for key in ("loss", "grad_norm"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5), (step, key)
    out = imported / "trained_hf"
    result = _cli("export", "--load", imported / "trained", "--vision-out", out / "vision", "--llm-out", out / "llm")
    assert result.returncode == 0, result.stderr[-3000:]
    llm = AutoModelForCausalLM.from_pretrained(out / "llm")
    AutoModel.from_pretrained(out / "vision")
    trained, original = _tensors(out / "llm"), _tensors(imported / "llm")
    assert trained.keys() == original.keys()
    assert not torch.equal(trained["model.norm.weight"], original["model.norm.weight"])  # it trained
    vision, original = _tensors(out / "vision"), _tensors(imported / "vision")
    assert vision.keys() == original.keys()
    head = [k for k in original if k.startswith("head.")]
    assert head and all(torch.equal(vision[k], original[k]) for k in head)  # not trained: as imported
    assert not torch.equal(vision["post_layernorm.weight"], original["post_layernorm.weight"])
    config = json.loads((out / "llm" / "config.json").read_text())
    assert config["num_key_value_heads"] == llm.config.num_key_value_heads


def test_image_normalization_is_the_imported_towers(imported, tmp_path):
    """The import records the tower's image processor normalization; training data takes it, and a
    flag naming other constants stops the run with one line."""
    sizes = sizes_from_dict(json.loads((imported / "ckpt" / "model.json").read_text())["sizes"])
    assert sizes.vision_arch.pixel_normalization == NORMALIZATION["siglip"]
    assert image_normalization(types.SimpleNamespace(image_normalization=None), sizes) == NORMALIZATION["siglip"]
    result = _one_process(["--model-sizes", str(imported / "ckpt" / "model.json"), "--image-normalization", "clip"],
                          tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "--image-normalization clip conflicts with the vision encoder's own" in errors[0]


@pytest.mark.parametrize("command, expected", [
    ("import --vision {t}/none --llm {t}/none --save {t}/c", "holds no *.safetensors file"),
    ("export --load {t} --llm-out {t}/o", "holds no checkpoint"),
    ("export --load {t}", "give --out DIR (a whole VLM), or --vision-out and/or --llm-out"),
])
def test_cli_errors_are_one_line(tmp_path, command, expected):
    result = _cli(*command.format(t=tmp_path).split())
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and expected in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
