"""Conversation data on disk (data/conversations.py): LLaVA JSON and JSONL, the shipped and Hugging
Face tokenizers with chat templates, image tiling and normalization, bad samples, and training from
the files (tools/make_dataset.py's output) on 2 non-colocated and 4 colocated ranks."""

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_hetero.boundary import assign_items
from megatron_hetero.data.bad_data import REASONS, DataError
from megatron_hetero.data.chat import CaptionChatTokenizer, HFChatTokenizer, TokenizerError, Turn, encode_conversation
from megatron_hetero.data.conversations import ConversationSamples, ConversationSpec
from megatron_hetero.data.images import NORMALIZATION, ImageSpec, load_tiles, tile_grid, tiles_of
from megatron_hetero.data.make_dataset import write_conversations, write_energon
from megatron_hetero.data.media import TileImages
from megatron_hetero.data.megatron_data import samples_dict
from megatron_hetero.data.shapes import ShapesDataset, all_captions
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.models.kinds import ENCODER_KINDS
from megatron_hetero.spec.sizes import ModelSizes
from tests.distributed import _free_port, run_python

ROOT = Path(__file__).parent.parent
SIZES = ModelSizes()
ROWS = SIZES.patches_per_image


def _dataset(path, seq_length=32, tokenizer=None, num_samples=None, tokens=ROWS, **spec):
    spec = ConversationSpec(str(path), str(Path(path).parent), seq_length,
                            TileImages(ImageSpec(SIZES.image_size), ROWS, tokens), **spec)
    tokenizer = tokenizer or CaptionChatTokenizer()
    return ConversationSamples(spec, tokenizer, num_samples or 10**6)


# A chat template in the style of the Hugging Face ones: role headers, an end-of-turn token.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
SPECIALS = ["<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def _hf_tokenizer(directory: Path, template: str | None = TEMPLATE, image_token: bool = True) -> str:
    """A word-level tokenizer trained on nothing (its vocabulary given), saved as a transformers
    tokenizer directory: what AutoTokenizer loads from a model's files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS + ["<image>"] * image_token
    words = sorted({w for c in all_captions() for w in c.split()} | {"describe", "repeat", "this", ":"})
    model = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>",
                                  additional_special_tokens=specials[2:])
    tok.chat_template = template
    tok.save_pretrained(directory)
    return str(directory)


def test_files_are_the_generators_samples(tmp_path):
    """One image per sample with the shipped tokenizer: the sequences, loss masks and positions of
    the synthetic batch (data/batches.py), images within PNG quantization; JSON and JSONL alike."""
    n = 12
    json_file = write_conversations(tmp_path / "a", n, seed=7)
    jsonl_file = write_conversations(tmp_path / "b", n, seed=7, jsonl=True)
    reference = samples_dict(ShapesDataset(7), list(range(n)), SIZES, [ENCODER_KINDS["vision"]], CaptionTokenizer())
    for path in (json_file, jsonl_file):
        ds = _dataset(path)
        got = ds.collate([ds[i] for i in range(n)])
        assert got.pop("skipped") == []
        for key in ("input_ids", "labels", "loss_mask", "vision_counts", "vision_positions"):
            assert torch.equal(got[key], reference[key]), key
        assert got["images"].shape == (n, 3, 32, 32)
        torch.testing.assert_close(got["images"], reference["images"], atol=0.5 / 255 + 1e-6, rtol=0)


def test_variable_images_and_text_only(tmp_path):
    """Several images per sample (one turn each) and text-only samples: each image's rows where its
    tag was, loss only on the assistant's captions and their <eos>; the ragged batch keeps counts."""
    from megatron_hetero.data.sample_batch import SampleBatch

    path = write_conversations(tmp_path, 30, seed=3, max_images=3, text_only=0.3)
    records = json.loads(path.read_text())
    ds, tok = _dataset(path, seq_length=96), CaptionTokenizer()
    samples = [ds[i] for i in range(len(records))]
    counts = [len(r["image"]) if isinstance(r.get("image"), list) else int("image" in r) for r in records]
    assert sorted(set(counts)) == [0, 1, 2, 3]
    for (sample, paths), record, count in zip(samples, records, counts):
        ids, media = sample.input_ids, sample.media["vision"]
        assert media.counts.tolist() == [count] and len(paths) == count
        assert torch.equal(media.positions, torch.nonzero(ids == tok.image_id).flatten())
        assert len(media.positions) == count * ROWS
        learned = ids[1:][sample.loss_mask[:-1].bool()].tolist()  # the tokens the loss predicts
        answers = [t["value"] for t in record["conversations"] if t["from"] == "gpt"]
        assert learned == sum((tok.encode(a) + [tok.eos_id] for a in answers), [])
    kwargs = SampleBatch.collate([s for s, _ in samples]).model_kwargs({"vision": "images"})
    assert kwargs["vision_counts"].tolist() == counts
    assert kwargs["images"].shape == (sum(counts), 3, 32, 32)
    assert torch.equal(kwargs["vision_positions"], torch.cat([s.media["vision"].positions for s, _ in samples]))


def test_energon_dataset_is_the_json(tmp_path):
    """A LLaVA JSON file converted to a megatron-energon dataset (tar shards, `energon prepare`) reads
    as the same samples, read by index through energon's indexed tar reader; a missing or corrupt
    image part skips its sample as a missing or corrupt file does."""
    path = write_conversations(tmp_path, 12, seed=3, max_images=3, text_only=0.25)
    records = json.loads(path.read_text())
    with_images = [i for i, r in enumerate(records) if r.get("image")]
    missing, corrupt = (records[i]["image"] for i in with_images[:2])
    (tmp_path / (missing if isinstance(missing, str) else missing[0])).unlink()
    (tmp_path / (corrupt if isinstance(corrupt, str) else corrupt[0])).write_bytes(b"\x89PNG\r\n\x1a\n broken")
    energon = write_energon(path, tmp_path / "energon", samples_per_shard=5)
    assert len(list(energon.glob("*.tar"))) == 3 and (energon / ".nv-meta" / "split.yaml").exists()
    a, b = _dataset(path, seq_length=96), _dataset(energon, seq_length=96)
    samples_a, samples_b = [a[i] for i in range(12)], [b[i] for i in range(12)]
    want, got = a.collate(samples_a), b.collate(samples_b)
    for key in want:
        if key != "skipped":
            assert torch.equal(got[key], want[key]), key
    reasons = [[bad.reason for bad in s.skipped] for s, _ in samples_b]
    assert reasons == [[bad.reason for bad in s.skipped] for s, _ in samples_a]
    assert sorted(sum(reasons, [])) == ["corrupt_image", "missing_image"]
    assert any(bad.file.startswith(f"{energon}/shard-00000.tar:") for s, _ in samples_b for bad in s.skipped)


def test_packing_puts_samples_back_to_back(tmp_path):
    """--pack-samples 2: each sequence is two samples' tokens back to back (padding after), their
    images' rows at the packed positions, the documents marking each, and the same loss tokens
    (targets) as unpacked; a pair longer than the sequence is one DataError naming the fix."""
    path = write_conversations(tmp_path, 8, seed=3, max_images=2, text_only=0.25)
    plain, packed = _dataset(path, seq_length=96), _dataset(path, seq_length=192, pack_samples=2)
    a = plain.collate([plain[i] for i in range(8)])
    b = packed.collate([packed[i] for i in range(8)])
    pad = CaptionTokenizer().pad_id
    assert b["input_ids"].shape == (4, 192) and b["document_ids"].shape == (4, 192)
    assert torch.equal(b["images"], a["images"])
    assert b["vision_counts"].tolist() == a["vision_counts"].view(4, 2).sum(1).tolist()
    for p in range(4):
        first, second = (a["input_ids"][2 * p + j] for j in range(2))
        n = [int((t != pad).nonzero().max()) + 1 for t in (first, second)]
        assert torch.equal(b["input_ids"][p, : sum(n)], torch.cat([first[: n[0]], second[: n[1]]]))
        assert (b["input_ids"][p, sum(n):] == pad).all()
        assert b["document_ids"][p].tolist() == [0] * n[0] + [1] * n[1] + [2] * (192 - sum(n))
        targets = [b["labels"][p][b["loss_mask"][p].bool()]]
        assert torch.equal(targets[0], torch.cat([a["labels"][2 * p + j][a["loss_mask"][2 * p + j].bool()]
                                                  for j in range(2)]))
    # Each image's rows where its tags are in the packed sequence.
    assert (b["input_ids"].flatten()[b["vision_positions"] + 192 * torch.repeat_interleave(
        torch.arange(4), b["vision_counts"] * ROWS)] == CaptionTokenizer().image_id).all()
    tight = _dataset(path, seq_length=64, pack_samples=2)
    too_long = (r"--pack-samples 2: samples \d+-\d+ of a global microbatch need \d+ tokens together, more than "
                r"--seq-length 64")
    with pytest.raises(DataError, match=too_long):
        tight.collate([tight[i] for i in range(8)])


def test_energon_dataset_as_megatron_lm_converts_llava_pretrain(tmp_path):
    """The shards Megatron-LM's examples/multimodal/convert_llava_pretrain_to_wds.py writes (per
    sample `jpg`: the image file's bytes, `json`: the conversation list), prepared by energon, read
    as the same samples as the LLaVA JSON file they came from."""
    import io
    import tarfile

    from megatron_hetero.data.make_dataset import prepare_energon

    path = write_conversations(tmp_path, 6, seed=2)  # one image per sample, as LLaVA-Pretrain
    out = tmp_path / "wds"
    out.mkdir()
    with tarfile.open(out / "pretrain-0.tar", "w") as shard:
        for entry in json.loads(path.read_text()):
            for part, data in (("jpg", (tmp_path / entry["image"]).read_bytes()),
                               ("json", json.dumps(entry["conversations"]).encode())):
                info = tarfile.TarInfo(f"{entry['id']}.{part}")
                info.size = len(data)
                shard.addfile(info, io.BytesIO(data))
    prepare_energon(out)
    a, b = _dataset(path), _dataset(out)
    want, got = a.collate([a[i] for i in range(6)]), b.collate([b[i] for i in range(6)])
    for key in want:
        assert key == "skipped" or torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("dp", [2, 3])
def test_only_encoding_ranks_decode(tmp_path, dp):
    """A rank decodes the images of the samples holding items its encoder DP rank encodes (the
    balanced assignment the model's boundary metadata carries); the rest stay NaN. Over the DP
    ranks every image is decoded, each as the rank holding everything decodes it."""
    path = write_conversations(tmp_path, 12, seed=1, max_images=3, text_only=0.25)
    tokens, width = 17, 64
    full = _dataset(path, seq_length=96, tokens=tokens, encoder_width=width)
    want = full.collate([full[i] for i in range(12)])
    owner = np.repeat(np.arange(12), want["vision_counts"].numpy())
    assignment = assign_items(np.full(len(owner), tokens), width, dp)
    assert not torch.isnan(want["images"]).any() and len(set(assignment)) == dp
    for rank in range(dp):
        part = _dataset(path, seq_length=96, tokens=tokens, encoder_width=width, decode_shares=((dp, rank),))
        got = part.collate([part[i] for i in range(12)])["images"]
        decoded = np.isin(owner, owner[assignment == rank])  # whole samples holding the rank's items
        assert torch.isnan(got[~decoded]).all() and torch.equal(got[decoded], want["images"][decoded])


def test_hf_tokenizer_chat_template(tmp_path):
    """A Hugging Face tokenizer directory: the ids are the rendered template's with every <image>
    tag repeated to its rows; the loss is on the assistant's turns (up to their end-of-turn token)."""
    directory = _hf_tokenizer(tmp_path / "tok")
    tok = HFChatTokenizer(directory)
    turns = [Turn("system", "describe this"), Turn("user", "<image>\nrepeat :"),
             Turn("assistant", "a red cross"), Turn("user", "<image> <image>"),
             Turn("assistant", "a blue circle in the top left")]
    rows = [3, 5, 2]
    ids, assistant = encode_conversation(tok, turns, rows)
    rendered = tok._tok.apply_chat_template([{"role": t.role, "content": t.text} for t in turns], tokenize=False)
    parts = rendered.split("<image>")
    expanded = parts[0] + "".join("<image>" * r + p for r, p in zip(rows, parts[1:]))
    assert ids == tok._tok.encode(expanded, add_special_tokens=False)
    tokens = tok._tok.convert_ids_to_tokens(ids)
    inside, expected = False, []
    for token in tokens:  # reference: from after <|assistant|> up to its <|end|>
        expected.append(inside)
        inside = token == "<|assistant|>" or (inside and token != "<|end|>")
    assert assistant == expected
    learned = "a red cross <|end|> a blue circle in the top left <|end|>".split()
    assert [t for t, a in zip(tokens, assistant) if a] == learned
    assert tok.vocab_size == len(tok._tok)


def test_hf_tokenizer_dataset(tmp_path):
    """The dataset with a Hugging Face tokenizer: image rows at the tags, the loss on the captions."""
    path = write_conversations(tmp_path / "data", 4, seed=2)
    tok = HFChatTokenizer(_hf_tokenizer(tmp_path / "tok"))
    ds = _dataset(path, seq_length=48, tokenizer=tok)
    sample, _ = ds[0]
    caption = json.loads(path.read_text())[0]["conversations"][1]["value"]
    learned = sample.input_ids[1:][sample.loss_mask[:-1].bool()].tolist()
    assert learned == tok.encode(caption) + [tok.eos_id]
    assert torch.equal(sample.media["vision"].positions, torch.nonzero(sample.input_ids == tok.image_id).flatten())


@pytest.mark.parametrize("template, image_token, message", [
    (None, True, "no chat template"), (TEMPLATE, False, "has no <image> token"),
    ("{{ messages|length }}" + TEMPLATE, True, "does not render a conversation's prefix")])
def test_hf_tokenizer_refused(tmp_path, template, image_token, message):
    with pytest.raises(TokenizerError, match=message):
        HFChatTokenizer(_hf_tokenizer(tmp_path, template, image_token))


def _png(path: Path, width: int, height: int, seed: int = 0) -> np.ndarray:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return pixels


def test_tiles_and_normalization(tmp_path):
    """A 2:1 image of 2 x 1 tiles' size: its two halves as they are, then the thumbnail; SigLIP and
    CLIP constants applied per channel."""
    assert tile_grid(64, 32, 4) == (2, 1) and tile_grid(32, 96, 6) == (1, 3) and tile_grid(40, 40, 1) == (1, 1)
    assert tiles_of(64, 32, ImageSpec(32, 4)) == 3 and tiles_of(64, 32, ImageSpec(32, 1)) == 1
    pixels = _png(tmp_path / "wide.png", 64, 32)
    thumbnail = np.array(Image.fromarray(pixels).resize((32, 32), Image.Resampling.BICUBIC))
    for name, (mean, std) in NORMALIZATION.items():
        tiles = load_tiles(tmp_path / "wide.png", ImageSpec(32, 4, (mean, std)))
        expected = [pixels[:, :32], pixels[:, 32:], thumbnail]
        mean, std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)
        for tile, want in zip(tiles, expected):
            torch.testing.assert_close(tile, (torch.from_numpy(want).permute(2, 0, 1) / 255 - mean) / std)
    assert load_tiles(tmp_path / "wide.png", ImageSpec(32)).shape == (1, 3, 32, 32)


def _bad_records(directory: Path) -> list:
    """JSONL lines: good samples, and one of each bad kind, with the reason expected for each line."""
    good = [json.loads(line) for line in write_conversations(directory, 6, seed=4, jsonl=True).read_text().splitlines()]
    _png(directory / "images" / "noise.png", 32, 32)
    (directory / "images" / "garbage.png").write_bytes(b"not an image at all")
    whole = (directory / "images" / "noise.png").read_bytes()
    (directory / "images" / "truncated.png").write_bytes(whole[: len(whole) // 2])

    def sample(name, image="images/noise.png", human="<image>", gpt="a red cross in the top left"):
        record = {"id": name, "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}
        return record if image is None else {**record, "image": image}

    lines = [
        (good[0], None),
        (sample("missing", image="images/nope.png"), "missing_image"),
        (sample("garbage", image="images/garbage.png"), "corrupt_image"),
        (sample("truncated", image="images/truncated.png"), "corrupt_image"),
        (good[1], None),
        (sample("long", gpt=" ".join(["a red cross"] * 10)), "too_long"),
        (sample("two tags", human="<image> <image>"), "image_count_mismatch"),
        (sample("no tag", human="describe"), "image_count_mismatch"),
        ({"id": "empty", "conversations": []}, "empty_conversation"),
        (sample("silent", gpt=" "), "empty_conversation"),
        (b'{"id": "latin-1", "conversations": [{"from": "human", "value": "caf\xe9"}, '
         b'{"from": "gpt", "value": "a red cross"}]}', "non_utf8"),
        (b'{"id": "cut", "conversations": [', "malformed"),
        (sample("who", image=None) | {"conversations": [{"from": "robot", "value": "a"}]}, "malformed"),
        (sample("clip", image=None, human="<video>") | {"video": "clip.mp4"}, "unsupported_media"),
        (good[2], None),
    ]
    return lines


def test_bad_samples_skipped(tmp_path):
    """Each bad sample is passed over to the next good one and reported with its reason."""
    lines = _bad_records(tmp_path)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r, _ in lines) + b"\n")
    ds = _dataset(path)
    good = [i for i, (_, reason) in enumerate(lines) if reason is None]
    # (the video and audio reasons need a model that takes them: tests/test_video.py, test_qwen2_5_omni.py)
    assert {reason for _, reason in lines} - {None} == set(REASONS) - {
        f"{what}_{kind}" for kind in ("video", "audio") for what in ("missing", "corrupt")} - {
        "video_count_mismatch", "audio_count_mismatch"}
    for i, (_, reason) in enumerate(lines):
        sample, _ = ds[i]
        target = next(g for g in good if g >= i)  # the next good record
        reference, _ = ds.encode(target)
        assert torch.equal(sample.input_ids, reference.input_ids)
        assert [b.reason for b in sample.skipped] == [r for _, r in lines[i:target]]
        for bad in sample.skipped:
            assert "sample " in bad.line() and (bad.file.endswith(".png") or bad.file == str(path))
    assert ds.collate([ds[1], ds[5]])["skipped"] == ds[1][0].skipped + ds[5][0].skipped


def test_resume_reads_the_same_samples(tmp_path):
    """The data position is Megatron's consumed-samples count: a loader started at k samples (a
    resumed run, Megatron's sampler over global microbatches as patches/hetero_data.py builds it)
    yields what the uninterrupted one yields from k on, bad samples passed over alike."""
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    lines = _bad_records(tmp_path)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r, _ in lines) + b"\n")
    ds, micro, total = _dataset(path, num_samples=40), 4, 40

    def batches(consumed):
        sampler = MegatronPretrainingSampler(total, consumed, micro, data_parallel_rank=0, data_parallel_size=1)
        loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=ds.collate, num_workers=1)
        return list(loader)

    whole, resumed = batches(0), batches(12)
    assert len(resumed) == len(whole) - 3
    for a, b in zip(whole[3:], resumed):
        assert a["skipped"] == b["skipped"] and all(torch.equal(a[k], b[k]) for k in a if k != "skipped")
    assert any(batch["skipped"] for batch in resumed)


def test_bad_json_list(tmp_path):
    """In a JSON list, non-UTF-8 text skips that sample only; a file that is not JSON is one error."""
    good = json.loads(write_conversations(tmp_path, 2, seed=4).read_text())
    bad = b'{"id": "x", "conversations": [{"from": "gpt", "value": "\xff"}]}'
    text = b"[" + json.dumps(good[0]).encode() + b", " + bad + b", " + json.dumps(good[1]).encode() + b"]"
    (tmp_path / "mixed.json").write_bytes(text)
    sample, _ = _dataset(tmp_path / "mixed.json")[1]
    assert [b.reason for b in sample.skipped] == ["non_utf8"]
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(DataError, match="broken.json: not JSON"):
        _dataset(tmp_path / "broken.json")
    (tmp_path / "none.jsonl").write_text(b'{"id": 1}\n'.decode())
    with pytest.raises(DataError, match="no usable sample"):
        _dataset(tmp_path / "none.jsonl")[0]


# Training from files through the script: short, tiny, on gloo.
ITERATIONS = 4
TIMEOUT = 400
ENV = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
LAYOUTS = ROOT / "examples" / "layouts"
FLAGS = ["--train-iters", str(ITERATIONS), "--global-batch-size", "8", "--micro-batch-size", "2",
         "--lr-warmup-iters", "1", "--log-interval", "1", "--seq-length", "64"]


def _pretrain(directory: Path, nproc: int, *flags: str, expect: int = 0) -> subprocess.CompletedProcess:
    """examples/pretrain_vlm.py through torchrun; past TIMEOUT the whole process group is killed."""
    directory.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         str(ROOT / "examples" / "pretrain_vlm.py"), "--metrics-file", str(directory / "metrics.jsonl"), *FLAGS,
         *flags], cwd=directory, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    assert proc.returncode == expect, f"{proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """Tool output (0-2 images per sample, a quarter text-only) with a missing image after sample 2."""
    directory = tmp_path_factory.mktemp("data")
    run_python([ROOT / "tools" / "make_dataset.py", "--out", directory, "--num-samples", "24", "--seed", "5",
                "--max-images", "2", "--text-only", "0.25"], env=ENV).check_returncode()
    records = json.loads((directory / "conversations.json").read_text())
    records.insert(3, {**records[0], "id": "gone", "image": "images/gone.png"})
    (directory / "conversations.json").write_text(json.dumps(records))
    return directory / "conversations.json"


def test_train_from_files(tmp_path, data_file):
    """2 ranks non-colocated (a DataLoader worker) and 4 ranks colocated train on the same samples,
    from the JSON file and (2 ranks) from the same samples as an energon dataset: the same loss per
    step (the layouts' parity), the skipped sample counted in the summary."""
    losses = []
    energon = write_energon(data_file, tmp_path / "energon")
    non_colocated = ["--hetero-layout", str(LAYOUTS / "gpu2_non_colocated.yaml"), "--num-workers", "1"]
    for name, nproc, data, flags in (("nc", 2, data_file, non_colocated),
                                     ("co", 4, data_file, ["--hetero-layout", str(LAYOUTS / "demo_colocated.yaml")]),
                                     ("energon", 2, energon, non_colocated)):
        result = _pretrain(tmp_path / name, nproc, "--data-path", str(data), *flags)
        # 32 samples read, records 0..24 once and 0..6 again: the missing image twice.
        assert "data: skipped samples: missing_image 2" in result.stdout, result.stdout[-2000:]
        assert result.stdout.count("warning: skipped") == 2
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, ITERATIONS + 1))
        losses.append([r["loss"] for r in records])
    assert all(math.isfinite(v) for v in losses[0]) and losses[0][-1] < losses[0][0], losses
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4)
    assert losses[2] == losses[0]  # the same samples, the same layout: bit for bit


@pytest.mark.parametrize("case", ["strict", "no usable sample"])
def test_data_errors_are_one_line(tmp_path, data_file, case):
    """--strict-data at a bad sample, or a file without a usable sample (raised in a DataLoader
    worker): one line naming the file and sample or the fix, exit 2, no traceback (one process,
    without torchrun, whose own report of a failed worker is a traceback)."""
    if case == "strict":
        flags, expected = ["--data-path", str(data_file), "--strict-data"], \
            r"--strict-data: .*gone\.png: sample gone: missing image"
    else:
        path = write_conversations(tmp_path / "data", 4, seed=1)
        for image in (path.parent / "images").iterdir():
            image.unlink()
        flags, expected = ["--data-path", str(path), "--num-workers", "1"], \
            r"conversations\.json: no usable sample \(first problem: .*missing image"
    port = _free_port()
    env = dict(ENV, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = run_python([ROOT / "examples" / "pretrain_vlm.py", *FLAGS, "--hetero-layout", LAYOUTS / "single.yaml",
                         *flags], cwd=tmp_path, env=env, timeout=TIMEOUT)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert re.search(expected, lines[0]), lines
    assert "Traceback" not in result.stderr
