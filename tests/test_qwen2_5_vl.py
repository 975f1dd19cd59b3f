"""Qwen2.5-VL (megatron_hetero/families/qwen2_5_vl) from a tiny random transformers model built offline:
our forward equals transformers' (logits within 1e-4 fp32, `hf compare`) on one process and under
vision TP2, vision DP2 -> LLM TP2, LLM CP2, LLM PP2 and non-colocated layouts, on conversation
data with images of different sizes (two in a sample, one over max pixels), a text-only sample and
bad images; the data's tokens and pixels are transformers' image processor's; import -> export is
bit-identical in both key spellings (the Hub's files, transformers' names), tied embeddings and bf16
included, and the export loads in transformers; 3 training steps under layouts equal one process's
(1e-4), at micro batch 2 and 1, and a checkpoint saved under one layout resumes under another. The
whole layout matrix of training runs under `make test-families` (pytest -m families)."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.distributed import collect_distributed, run_distributed, run_python
from tests.test_checkpoint import _train, at
from tests.vlm_fixtures import IMAGE_SIZES, MAX_PIXELS, MERGE, PATCH, conversations, qwen2_5_vl_dir

SEQ = 256
TOL = 1e-4
# 2-rank layouts: vision TP2 (LLM DP2), vision DP2 -> LLM TP2 without and with SP, LLM CP2, LLM PP2,
# non-colocated, vision CP2 (each image's merge blocks split, windows cut between the ranks) -> LLM TP2.
LAYOUTS = {
    "vcp2_ltp2": "placement: colocated\nmodules:\n  vision: {role: encoder, cp: 2}\n  llm: {role: llm, tp: 2}\n",
    "vtp2": "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 2}\n  llm: {role: llm, dp: 2}\n",
    "vdp2_ltp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, tp: 2}\n",
    "vdp2_ltp2sp": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n"
                   "  llm: {role: llm, tp: 2, sp: true}\n",
    "lcp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, cp: 2}\n",
    "lpp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, pp: 2}\n",
    "noncolocated": "placement: non_colocated\nmodules:\n  vision: {role: encoder, ranks: 0-0}\n"
                    "  llm: {role: llm, ranks: 1-1}\n",
    "single": "placement: colocated\nmodules:\n  vision: {role: encoder}\n  llm: {role: llm}\n",
}


def _cli(*args):
    return run_python(["-m", "megatron_hetero.hf", *args])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """The model directory, its conversation data, its import and the layout files."""
    tmp = tmp_path_factory.mktemp("qwen2_5_vl")
    qwen2_5_vl_dir(tmp / "hf")
    data = conversations(tmp / "data")
    result = _cli("import", "--model", tmp / "hf", "--save", tmp / "ckpt")
    assert result.returncode == 0, result.stderr[-3000:]
    for name, text in LAYOUTS.items():
        (tmp / f"{name}.yaml").write_text(text)
    return tmp, data


def _compare_args(tmp: Path, data: Path, *extra) -> list[str]:
    return ["compare", "--model", str(tmp / "hf"), "--load", str(tmp / "ckpt"), "--data-path", str(data),
            "--seq-length", str(SEQ), *map(str, extra)]


def _report(text: str, samples: int = 5) -> tuple[list[float], float]:
    """Per-sample max |logit diff| and the summary's (over `samples` samples)."""
    lines = text.strip().splitlines()
    per_sample = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("sample ")]
    summary = lines[-1]
    assert summary.startswith("max |logit diff|") and f" over {samples} samples" in summary, summary
    return per_sample, float(summary.split()[3])


def test_compare_one_process(qwen):
    """Our forward (one process) against transformers' on 5 samples: images of different sizes, two
    in one sample, one over max pixels, a text-only sample; the corrupt and missing images skipped.
    Above the tolerance, exit code 1."""
    tmp, data = qwen
    result = _cli(*_compare_args(tmp, data))
    assert result.returncode == 0, result.stderr[-3000:]
    per_sample, worst = _report(result.stdout)
    print(result.stdout)
    assert len(per_sample) == 5 and max(per_sample) == worst <= TOL
    assert "(corrupt_image)" in result.stdout and "(missing_image)" in result.stdout
    strict = _cli(*_compare_args(tmp, data, "--tolerance", 0))
    assert strict.returncode == 1 and worst > 0


def _compare_worker(rank, world_size, tmp, data, layouts):
    """`hf compare --hetero-layout` under each of `layouts` (files tmp/<name>.yaml) in turn, in one
    launch: name -> (exit code, stdout)."""
    from megatron_hetero.hf.__main__ import main

    results = {}
    for name in layouts:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(_compare_args(Path(tmp), Path(data), "--hetero-layout", Path(tmp) / f"{name}.yaml"))
        results[name] = (code, out.getvalue())
    return results


def test_compare_under_layouts(qwen, tmp_path):
    """`hf compare --hetero-layout` on 2 processes (one launch, every layout): logits gathered over
    TP/CP/PP equal transformers' within 1e-4 on every sample."""
    tmp, data = qwen
    layouts = [name for name in LAYOUTS if name not in ("single", "vdp2_ltp2")]
    rank0 = collect_distributed(_compare_worker, 2, tmp_path, str(tmp), str(data), layouts)[0]
    for name, (code, text) in rank0.items():
        print(name, text.strip().splitlines()[-1])
        per_sample, worst = _report(text)
        assert code == 0 and len(per_sample) == 5 and worst <= TOL, (name, text)


# ---- data -------------------------------------------------------------------------------------
def test_data_is_the_processors(qwen):
    """Each <image> tag is <|vision_start|>, one <|image_pad|> per merged patch of the image as
    transformers' image processor cuts it, <|vision_end|>; pixels are the processor's; an image over
    max pixels is resized within them; M-RoPE positions are transformers' get_rope_index's."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from megatron_hetero.data.chat import HFChatTokenizer
    from megatron_hetero.data.conversations import ConversationSamples, ConversationSpec
    from megatron_hetero.families import family_named
    from megatron_hetero.spec.sizes import sizes_from_dict

    tmp, data = qwen
    description = json.loads((tmp / "ckpt" / "model.json").read_text())
    sizes = sizes_from_dict(description["sizes"])
    images = family_named("qwen2_5_vl").media(sizes, description["processor"], description["hf"]["config"])
    dataset = ConversationSamples(ConversationSpec(str(data), str(data.parent), SEQ, images),
                                  HFChatTokenizer(str(tmp / "hf"), image_token=False), 1)
    processor, tok = Qwen2VLImageProcessorPil.from_pretrained(tmp / "hf"), AutoTokenizer.from_pretrained(tmp / "hf")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp / "hf")
    records = json.loads(data.read_text())
    for index in (0, 1, 4, 5, 6):  # 2 and 3 are the corrupt and the missing image
        sample, sources = dataset.encode(index)
        dataset.collate([(sample, sources)])  # decodes its images
        paths = [source.source for source in sources]
        want = processor(images=[Image.open(p) for p in paths], return_tensors="pt") if paths else None
        media = sample.media["vision"]
        roles = {"human": "user", "gpt": "assistant"}
        text = tok.apply_chat_template([{"role": roles[t["from"]], "content": t["value"]}
                                        for t in records[index]["conversations"]], tokenize=False)
        for grid in (want["image_grid_thw"] if paths else []):
            pads = "<|image_pad|>" * int(grid.prod() // MERGE**2)
            text = text.replace("<image>", f"<|vision_start|>{pads}<|vision_end|>", 1)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert sample.input_ids[: len(ids)].tolist() == ids and sample.input_ids[len(ids):].eq(tok.pad_token_id).all()
        if paths:
            assert torch.equal(media.grids, want["image_grid_thw"]) and torch.equal(media.items, want["pixel_values"])
            assert all(int(g[1] * g[2]) * PATCH**2 <= MAX_PIXELS for g in media.grids)
        mm = (sample.input_ids == images.image_tokens.placeholder).int()[None]
        positions, _ = model.model.get_rope_index(sample.input_ids[None], mm, media.grids if paths else None)
        assert torch.equal(sample.position_ids, positions[:, 0]) if paths else sample.position_ids.eq(
            torch.arange(SEQ)).all()
    big = IMAGE_SIZES["big.png"]
    assert big[0] * big[1] > MAX_PIXELS


# ---- import / export --------------------------------------------------------------------------
def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _transformers_names(directory: Path) -> None:
    """Rewrite the directory's weights under transformers 5's in-memory names (what the Hub's
    `visual.*` / `model.*` become on load)."""
    tensors = {("model.visual." + k[len("visual."):]) if k.startswith("visual.") else
               ("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
               for k, v in _tensors(directory).items()}
    for f in directory.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("variant", ["hub_fp32", "transformers_names_tied_bf16"])
def test_import_export_round_trip(tmp_path, variant):
    """import -> export gives the imported files back bit for bit (keys in the imported spelling,
    dtypes, every tensor), with the tokenizer, chat template and processor files; transformers loads
    the export and computes what the original does."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    src = qwen2_5_vl_dir(tmp_path / "hf", tied=variant.endswith("bf16"))
    if variant.endswith("bf16"):
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(src, dtype=torch.bfloat16)
        model.save_pretrained(src)
        _transformers_names(src)
        tensors = _tensors(src)  # a tied output layer some files carry as a copy of the embedding
        tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    original = _tensors(src)
    assert any(k.startswith("model.visual.") for k in original) == variant.startswith("transformers")
    for command in (("import", "--model", src, "--save", tmp_path / "ckpt"),
                    ("export", "--load", tmp_path / "ckpt", "--out", tmp_path / "out")):
        result = _cli(*command)
        assert result.returncode == 0, result.stderr[-3000:]
    exported = _tensors(tmp_path / "out")
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes(), name
    a, b = (Qwen2_5_VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32) for d in (src, tmp_path / "out"))
    ids = torch.arange(5, 25)[None]
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_import_refusals(tmp_path):
    """A tensor no rule maps, a tied copy that differs from its original, a model type no family
    maps: one error line each, nothing written."""
    src = qwen2_5_vl_dir(tmp_path / "hf")
    tensors = _tensors(src)
    save_file({**tensors, "visual.extra.weight": torch.zeros(2)}, src / "model.safetensors")
    result = _cli("import", "--model", src, "--save", tmp_path / "ckpt")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: qwen2_5_vl: tensor "
                                                                                        "visual.extra.weight")
    assert not (tmp_path / "ckpt" / "release").exists()
    tied = qwen2_5_vl_dir(tmp_path / "tied", tied=True)
    save_file({**_tensors(tied), "lm_head.weight": torch.zeros(1)}, tied / "model.safetensors")
    result = _cli("import", "--model", tied, "--save", tmp_path / "ckpt")
    assert result.returncode == 2 and "lm_head.weight differs from model.embed_tokens.weight" in result.stderr
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    result = _cli("import", "--model", src, "--save", tmp_path / "ckpt")
    assert result.returncode == 2 and "is not a VLM family this version maps" in result.stderr


# ---- training ---------------------------------------------------------------------------------
def _train_flags(tmp: Path, data: Path, iters: int = 3) -> list[str]:
    return ["--model-sizes", str(tmp / "ckpt" / "model.json"), "--load", str(tmp / "ckpt"), "--data-path", str(data),
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp / "hf"),
            "--seq-length", str(SEQ), "--train-iters", str(iters), "--global-batch-size", "4",
            "--micro-batch-size", "2", "--log-interval", "100", "--seed", "7"]


def train(tmp: Path, data: Path, tag: str, layout: str, world: int, flags=()) -> dict[int, dict]:
    """examples/pretrain_vlm.py from the import under `layout`; its metrics per step."""
    out = tmp / "runs" / tag
    out.mkdir(parents=True)
    run_distributed(_train, world, ["--hetero-layout", str(tmp / f"{layout}.yaml"), "--metrics-file",
                                    str(out / "metrics.jsonl"), *_train_flags(tmp, data), *flags])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


@pytest.fixture(scope="module")
def reference(qwen):
    return train(*qwen, "reference", "single", 1)


def assert_same_steps(reference: dict, got: dict, rel: float = TOL, first: int = 1) -> None:
    assert sorted(got) == list(range(first, max(reference) + 1)), sorted(got)
    for step in got:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(reference[step][key], rel=rel), (step, key)


@pytest.mark.parametrize("layout", ["vtp2", "noncolocated"])
def test_training_equals_one_process(qwen, reference, layout):
    """3 steps from the import under a colocated (vision TP2, LLM DP2) and a non-colocated layout:
    loss and gradient norm per step within 1e-4 of one process's."""
    assert_same_steps(reference, train(*qwen, layout, layout, 2))


@pytest.mark.families
@pytest.mark.parametrize("layout", ["vdp2_ltp2sp", "lcp2", "lpp2", "vcp2_ltp2"])
def test_training_equals_one_process_matrix(qwen, reference, layout):
    """The rest of the matrix: vision DP2 -> LLM TP2 with SP, LLM CP2, LLM PP2, vision CP2 -> LLM TP2."""
    assert_same_steps(reference, train(*qwen, layout, layout, 2))


# Micro batch 1: the LLM input's [b, s, h] -> [s, b, h] transpose is contiguous already, so views reach
# the writes that larger batches make into copies.
MICRO_BATCH_1 = ["--micro-batch-size", "1"]


@pytest.fixture(scope="module")
def reference_micro_batch_1(qwen):
    return train(*qwen, "reference_mbs1", "single", 1, MICRO_BATCH_1)


@pytest.mark.parametrize("layout", ["vdp2_ltp2", *(pytest.param(name, marks=pytest.mark.families) for name in
                                                   ("vdp2_ltp2sp", "vtp2", "lcp2", "lpp2", "noncolocated"))])
def test_micro_batch_1_equals_one_process(qwen, reference_micro_batch_1, layout):
    """Micro batch 1 under every layout kind (vision DP2 -> LLM TP2 without SP in `make test`; with SP,
    vision TP2, LLM CP2, LLM PP2 and non-colocated under `families`): 3 steps equal one process's."""
    assert_same_steps(reference_micro_batch_1, train(*qwen, f"{layout}_mbs1", layout, 2, MICRO_BATCH_1))


@pytest.mark.families
def test_packed_samples_equal_unpacked(qwen):
    """--pack-samples 2 (two samples per sequence, M-RoPE positions per sample) under LLM CP2 equals
    the unpacked one-process run at the same sequence length."""
    longer = ["--seq-length", str(2 * SEQ)]
    plain = train(*qwen, "plain", "single", 1, longer)
    assert_same_steps(plain, train(*qwen, "packed", "lcp2", 2, [*longer, "--pack-samples", "2"]))


def test_checkpoint_resumes_under_another_layout(qwen):
    """Saved at step 2 under LLM PP2 (vision DP2), resumed for step 3 under vision TP2 -> LLM DP2:
    step 3 equals the uninterrupted PP2 run's within 1e-5."""
    tmp, data = qwen
    saved = tmp / "saved"
    straight = train(tmp, data, "straight", "lpp2", 2, ["--save", str(saved), "--save-interval", "2"])
    resumed = train(tmp, data, "resumed", "vtp2", 2, ["--load", str(at(saved, 2, "vtp2"))])
    assert_same_steps(straight, resumed, rel=1e-5, first=3)


@pytest.mark.parametrize("layout_text, flags, expected", [
    ("placement: colocated\nmodules:\n  vision: {role: encoder, tp: 4}\n  llm: {role: llm, dp: 4}\n", (),
     "model.json's enc_num_attention_heads 2 is not divisible by module vision's tp=4; set the module's tp: to "
     "a divisor of 2 (1, 2)"),
    ("placement: non_colocated\nmodules:\n  vision: {role: encoder, pp: 2, ranks: 0-1}\n"
     "  llm: {role: llm, dp: 2, ranks: 2-3}\n", (),
     "module vision: the qwen2_5_vl vision tower runs as one pipeline stage; set its pp: 1"),
    ("placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4}\n  llm: {role: llm, dp: 4}\n",
     ("--data-path", None), "describes a qwen2_5_vl model: train it on conversation data (--data-path FILE)"),
])
def test_training_refusals(qwen, tmp_path, layout_text, flags, expected):
    """What a Qwen2.5-VL model cannot train with: one `error:` line naming the layout field or flag."""
    from tests.test_pretrain_errors import _run

    tmp, data = qwen
    args = [a for a in _train_flags(tmp, data) if not flags or a not in (flags[0], str(data))]
    result = _run(["--hetero-layout", "layout.yaml", *args], tmp_path, layout_text)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert expected in result.stderr.strip().splitlines()[-1], result.stderr[-500:]
