"""Video input for Qwen2.5-VL and Qwen3-VL (data/video.py, families/qwen2_5_vl/video.py,
families/qwen3_vl/media.py) on tiny random transformers models and synthetic videos encoded with
PyAV: a video without an image, an image and a video in one sample, a video as frame images, a video
longer than the frame limit, in LLaVA-style and ShareGPT-style records. The data is transformers'
(its video processors' pixels, grids and frames; its processors' tokens, Qwen3-VL's timestamps
included; M-RoPE positions equal to get_rope_index's, Qwen2.5-VL's seconds per grid included); bad
videos are skipped with their reason; our forward equals transformers' (logits within 1e-4) on one
process, on a batch mixing images and videos, and under layouts (one in the default suite, the
matrix under `-m families`)."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from tests.distributed import collect_distributed
from tests.qwen3_vl_models import model_class as qwen3_class
from tests.qwen3_vl_models import qwen3_vl_dir
from tests.vlm_fixtures import VIDEO_SETTINGS, qwen2_5_vl_dir, save_video_settings, video_conversations

pytest.importorskip("av")

SEQ, TOL = 320, 1e-4
GOOD = ("v0", "v6", "v7", "v8", "v9")  # the usable samples of video_conversations()
MIXED = ("v8", "v7", "v6")  # an image, a video as frames, an image and a video: one microbatch
SKIPPED = {"v1": "corrupt_video", "v2": "corrupt_video", "v3": "missing_video", "v4": "video_count_mismatch",
           "v5": "unsupported_media"}
LAYOUTS = {
    "vtp2": "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 2}\n  llm: {role: llm, dp: 2}\n",
    "vdp2_ltp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, tp: 2}\n",
    "lcp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, cp: 2}\n",
    "lpp2": "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, pp: 2}\n",
    "noncolocated": "placement: non_colocated\nmodules:\n  vision: {role: encoder, ranks: 0-0}\n"
                    "  llm: {role: llm, ranks: 1-1}\n",
    "single": "placement: colocated\nmodules:\n  vision: {role: encoder}\n  llm: {role: llm}\n",
}


def _hf_class(family: str):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration if family == "qwen2_5_vl" else qwen3_class(False)


def _one_process(rank, world_size, tmp, data):
    """In one process (one start-up): `hf import` of the model, `hf compare` on the video data (exit
    code, stdout), and our logits of one global microbatch holding an image sample, a video sample
    (a frame list), and an image and a video in one sample (the tower encodes every item in one call)."""
    from megatron_hetero.hf.__main__ import main
    from megatron_hetero.hf.checkpoint import loaded_model
    from megatron_hetero.hf.compare import _our_logits
    from megatron_hetero.spec.sizes import sizes_from_dict

    tmp = Path(tmp)
    assert main(["import", "--model", str(tmp / "hf"), "--save", str(tmp / "ckpt")]) == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(map(str, _compare_args(tmp, Path(data)))))
    dataset = _dataset(tmp, Path(data))
    samples, _ = _samples(dataset)
    kwargs = dataset.collate([samples[name] for name in MIXED])
    kwargs.pop("skipped")
    sizes = sizes_from_dict({**json.loads((tmp / "ckpt" / "model.json").read_text())["sizes"], "seq_length": SEQ})
    with loaded_model(str(tmp / "ckpt"), sizes) as model:  # main() applied the patches
        ours = _our_logits(model, kwargs, SEQ)
    return code, out.getvalue(), [ours[j][:, : sizes.vocab_size] for j in range(len(MIXED))]


def _build(tmp: Path, family: str) -> tuple[Path, Path, tuple]:
    """The family's model directory (its video processor's settings saved), the video data, the
    layout files, and what _one_process returns."""
    (qwen2_5_vl_dir if family == "qwen2_5_vl" else qwen3_vl_dir)(tmp / "hf")
    save_video_settings(tmp / "hf", family)
    data = video_conversations(tmp / "data")
    for name, text in LAYOUTS.items():
        (tmp / f"{name}.yaml").write_text(text)
    return tmp, data, collect_distributed(_one_process, 1, tmp, str(tmp), str(data))[0]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def built(request, tmp_path_factory):
    """(family, its directory, the video data, _one_process's results); one build per family."""
    return request.param, *_build(tmp_path_factory.mktemp(request.param), request.param)


def _dataset(tmp: Path, data: Path, seq: int = SEQ):
    from megatron_hetero.data.chat import HFChatTokenizer
    from megatron_hetero.data.conversations import ConversationSamples, ConversationSpec
    from megatron_hetero.families import family_named
    from megatron_hetero.spec.sizes import sizes_from_dict

    description = json.loads((tmp / "ckpt" / "model.json").read_text())
    sizes = sizes_from_dict(description["sizes"])
    media = family_named(sizes.family).media(sizes, description["processor"], description["hf"]["config"])
    return ConversationSamples(ConversationSpec(str(data), str(data.parent), seq, media),
                               HFChatTokenizer(str(tmp / "hf"), image_token=False), 1)


def _samples(dataset) -> dict:
    """sample id -> (Sample, its media sources), decoded; and the bad samples' reasons."""
    records = json.loads(Path(dataset.spec.path).read_text())
    out, skipped = {}, {}
    for index, record in enumerate(records):
        sample, sources = dataset[index]
        skipped.update({b.sample: b for b in sample.skipped})
        if not sample.skipped:
            dataset.collate([(sample, sources)])
            out[record["id"]] = (sample, sources)
    return out, skipped


# ---- data ---------------------------------------------------------------------------------------
def test_data_positions_and_skips(built):
    """Every usable sample's M-RoPE positions are transformers' get_rope_index's on its items (images
    and videos apart, Qwen2.5-VL's seconds per grid); the video over the frame limit keeps
    max_frames; each bad video is skipped with its reason (one line naming the sample)."""
    family, tmp, data, _ = built
    dataset = _dataset(tmp, data)
    samples, skipped = _samples(dataset)
    assert sorted(samples) == sorted(GOOD) and {k: b.reason for k, b in skipped.items()} == SKIPPED
    model = _hf_class(family).from_pretrained(tmp / "hf")
    for name, (sample, sources) in samples.items():
        ids = sample.input_ids[None]
        inputs = dataset.spec.images.hf_inputs(ids, sample.media["vision"], [s.items for s in sources])
        grids = {k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
        if family == "qwen3_vl":
            grids.pop("second_per_grid_ts")
        positions, _ = model.model.get_rope_index(ids, inputs["mm_token_type_ids"], **grids)
        assert torch.equal(sample.position_ids, positions[:, 0]), name
    long = next(s for s in samples["v9"][1] if s.kind == "video")
    assert len(long.items.frames) == VIDEO_SETTINGS[family]["max_frames"] and long.items.grids[0][0] == 3
    for name, bad in skipped.items():
        assert "\n" not in bad.line() and f"sample {name}: " in bad.line(), bad.line()


@pytest.mark.parametrize("built", ["qwen3_vl"], indirect=True)
def test_energon_dataset_is_the_json(built, tmp_path):
    """The video data converted to a megatron-energon dataset (videos and frames as parts of their
    samples) reads as the same samples: tokens, positions, decoded pixels, the same skips."""
    pytest.importorskip("megatron.energon")
    from megatron_hetero.data.make_dataset import write_energon

    _, tmp, data, _ = built
    energon = write_energon(data, tmp_path / "energon")
    a, b = _dataset(tmp, data), _dataset(tmp, energon)
    samples_a, samples_b = [a[i] for i in range(len(a.records))], [b[i] for i in range(len(b.records))]
    want, got = a.collate(samples_a), b.collate(samples_b)
    for key in want:
        if key != "skipped":
            assert torch.equal(got[key], want[key]), key
    assert [bad.reason for bad in got["skipped"]] == [bad.reason for bad in want["skipped"]]
    assert {bad.reason for bad in got["skipped"]} == set(SKIPPED.values())


def _processor(family: str, directory: Path):
    """transformers' whole processor of the model directory (its video processor needs torchvision)."""
    from transformers import AutoTokenizer, Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings = {**VIDEO_SETTINGS[family], "cap_pixels_per_frame": False}
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLProcessor as Processor

        video = Qwen2VLVideoProcessor(**settings)
    else:
        from transformers import Qwen3VLProcessor as Processor

        video = Qwen3VLVideoProcessor(**settings)
    return Processor(Qwen2VLImageProcessorPil.from_pretrained(directory), AutoTokenizer.from_pretrained(directory),
                     video)


def test_data_is_the_processors(built):
    """Tokens, pixels, grids and frames are transformers' processor's (its video processor on the
    frames PyAV decodes, with their metadata): Qwen3-VL's timestamps, each temporal patch's tokens."""
    pytest.importorskip("torchvision")
    from PIL import Image
    from transformers.video_utils import load_video

    family, tmp, data, _ = built
    dataset = _dataset(tmp, data)
    samples, _ = _samples(dataset)
    processor, records = _processor(family, tmp / "hf"), {r["id"]: r for r in json.loads(data.read_text())}
    for name, (sample, sources) in samples.items():
        record = records[name]
        turns = record.get("conversations") or record["messages"]
        messages = [{"role": {"human": "user", "gpt": "assistant"}.get(t.get("from"), t.get("role")),
                     "content": t.get("value", t.get("content"))} for t in turns]
        text = processor.tokenizer.apply_chat_template(messages, tokenize=False)
        text = text.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>").replace(
            "<video>", "<|vision_start|><|video_pad|><|vision_end|>" if family == "qwen2_5_vl" else "<|video_pad|>")
        images = [Image.open(s.source) for s in sources if s.kind == "image"] or None
        videos, metadata = [], []
        for s in (s for s in sources if s.kind == "video"):
            if isinstance(s.source, list):  # frames: transformers takes them as they are
                videos.append([Image.open(f) for f in s.source])
                metadata.append(None)
            else:
                frames, meta = load_video(str(s.source), backend="pyav")
                videos.append(frames)
                metadata.append(meta)
        kwargs = {}
        if videos:
            kwargs = dict(videos=videos, do_sample_frames=metadata[0] is not None)
            kwargs |= {"video_metadata": metadata} if all(metadata) else {}
        want = processor(text=[text], images=images, return_tensors="pt", **kwargs)
        ids = want["input_ids"][0]
        assert torch.equal(sample.input_ids[: len(ids)], ids), name
        inputs = dataset.spec.images.hf_inputs(sample.input_ids[None], sample.media["vision"],
                                               [s.items for s in sources])
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            assert (key in want) == (key in inputs) and (key not in want or torch.equal(inputs[key], want[key])), key
        if "second_per_grid_ts" in want:
            assert torch.equal(inputs["second_per_grid_ts"], torch.as_tensor(want["second_per_grid_ts"])), name


# ---- our forward against transformers' ----------------------------------------------------------
def _compare_args(tmp: Path, data: Path, *extra) -> list:
    return ["compare", "--model", tmp / "hf", "--load", tmp / "ckpt", "--data-path", data, "--seq-length", SEQ,
            *extra]


def _report(text: str) -> list[float]:
    """Per-sample max |logit diff| (checking the summary counts every usable sample)."""
    lines = text.strip().splitlines()
    assert lines[-1].startswith("max |logit diff|") and f" over {len(GOOD)} samples" in lines[-1], lines[-1]
    return [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("sample ")]


def test_compare_one_process(built):
    """`hf compare` on one process: every usable video sample within 1e-4 of transformers' logits,
    the bad ones listed as skipped."""
    code, stdout, _ = built[3]
    per_sample = _report(stdout)
    assert code == 0 and len(per_sample) == len(GOOD) and max(per_sample) <= TOL, stdout
    assert all(f"({reason})" in stdout for reason in SKIPPED.values())


def test_mixed_batch_one_process(built):
    """Images and videos in one microbatch on one process: each sample's logits equal transformers'."""
    family, tmp, data, (_, _, ours) = built
    dataset = _dataset(tmp, data)
    samples, _ = _samples(dataset)
    model = _hf_class(family).from_pretrained(tmp / "hf", dtype=torch.float32).eval()
    for mine, name in zip(ours, MIXED):
        sample, sources = samples[name]
        ids = sample.input_ids[None]
        with torch.no_grad():
            theirs = model(input_ids=ids, **dataset.spec.images.hf_inputs(ids, sample.media["vision"],
                                                                         [s.items for s in sources])).logits[0]
        assert (mine - theirs).abs().max() <= TOL, name


def _compare_worker(rank, world_size, tmp, data, layouts):
    from megatron_hetero.hf.__main__ import main

    results = {}
    for name in layouts:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(list(map(str, _compare_args(Path(tmp), Path(data), "--hetero-layout",
                                                    Path(tmp) / f"{name}.yaml"))))
        results[name] = (code, out.getvalue())
    return results


def _compare_under(built, layouts, tmp_path) -> None:
    _, tmp, data, _ = built
    rank0 = collect_distributed(_compare_worker, 2, tmp_path, str(tmp), str(data), layouts)[0]
    for name, (code, text) in rank0.items():
        per_sample = _report(text)
        assert code == 0 and len(per_sample) == len(GOOD) and max(per_sample) <= TOL, (name, text)


@pytest.mark.parametrize("built", ["qwen3_vl"], indirect=True)
def test_compare_under_a_layout(built, tmp_path):
    """Vision TP2 under LLM DP2 (Qwen3-VL; Qwen2.5-VL's under -m families): the tower encodes both
    samples' images and videos in one call."""
    _compare_under(built, ["vtp2"], tmp_path)


@pytest.mark.families
def test_compare_under_layouts(built, tmp_path):
    """Every layout of LAYOUTS (both families), vision DP2 -> LLM TP2, CP2, PP2, non-colocated."""
    _compare_under(built, [name for name in LAYOUTS if name != "single" and (built[0], name) != ("qwen3_vl", "vtp2")],
                   tmp_path)


# ---- training -----------------------------------------------------------------------------------
def _train(built, layout: str, world: int) -> dict[int, dict]:
    """3 steps of examples/pretrain_vlm.py on the video data (global batch 4: every usable sample,
    the bad ones skipped) under `layout`; its metrics per step."""
    from tests.test_qwen2_5_vl import train

    _, tmp, data, _ = built
    return train(tmp, data, layout, layout, world, ["--seq-length", str(SEQ)])


@pytest.fixture(scope="module")
def reference(built):
    return _train(built, "single", 1)


@pytest.mark.families
@pytest.mark.parametrize("layout", ["vdp2_ltp2", "noncolocated"])
def test_training_equals_one_process(built, reference, layout):
    """Training on videos and images: loss and gradient norm per step within 1e-4 of one process's."""
    from tests.test_qwen2_5_vl import assert_same_steps

    assert_same_steps(reference, _train(built, layout, 2))
