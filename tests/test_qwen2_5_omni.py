"""Qwen2.5-Omni (megatron_hetero/families/qwen2_5_omni) from a tiny random transformers model built
offline (thinker, talker and token2wav): import -> export is bit-identical with every tensor of the
files (the talker and token2wav passed through), in both key spellings; our forward equals
transformers' thinker's (logits within 1e-4 fp32, `hf compare`) on samples with audio (resampled,
stereo, a last chunk of 2 frames, two in a sample), an image and audio together, an image alone and
text alone, the bad audio skipped; the audio encoder under CP2 equal to the whole encoder; under the
`families` marker, the same under layouts (vision DP2, audio DP2 -> LLM TP2 colocated; both encoders
at CP2 -> LLM TP2; non-colocated) and 3 training steps under them equal to one process's."""

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.distributed import collect_distributed, run_python
from tests.omni_fixtures import audio_conversations, qwen2_5_omni_dir, track_conversations
from tests.test_qwen2_5_vl import _compare_args, _compare_worker, _report, assert_same_steps, train

TOL = 1e-4
SAMPLES = 7  # the usable samples of the audio data
# name -> (processes, layout): vision DP2 and audio DP2 -> LLM TP2 colocated; each module on its own
# process (non-colocated)
LAYOUTS = {
    "vdp2_adp2_ltp2": (2, "placement: colocated\nedges: [vision -> llm, audio -> llm]\nmodules:\n"
                          "  vision: {role: encoder, dp: 2}\n  audio: {role: encoder, dp: 2}\n"
                          "  llm: {role: llm, tp: 2}\n"),
    "vtp2_atp2": (2, "placement: colocated\nedges: [vision -> llm, audio -> llm]\nmodules:\n"
                     "  vision: {role: encoder, tp: 2}\n  audio: {role: encoder, tp: 2}\n  llm: {role: llm, dp: 2}\n"),
    "vcp2_acp2_ltp2": (2, "placement: colocated\nedges: [vision -> llm, audio -> llm]\nmodules:\n"
                          "  vision: {role: encoder, cp: 2}\n  audio: {role: encoder, cp: 2}\n"
                          "  llm: {role: llm, tp: 2}\n"),
    "single": (1, "placement: colocated\nedges: [vision -> llm, audio -> llm]\nmodules:\n"
                  "  vision: {role: encoder}\n  audio: {role: encoder}\n  llm: {role: llm}\n"),
    "noncolocated": (3, "placement: non_colocated\nedges: [vision -> llm, audio -> llm]\nmodules:\n"
                        "  vision: {role: encoder, ranks: 0-0}\n  audio: {role: encoder, ranks: 1-1}\n"
                        "  llm: {role: llm, ranks: 2-2}\n"),
}


def _cli(*args):
    return run_python(["-m", "megatron_hetero.hf", *map(str, args)])


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """The model directory, its audio conversation data and its import."""
    tmp = tmp_path_factory.mktemp("qwen2_5_omni")
    return imported(tmp, qwen2_5_omni_dir(tmp / "hf"), LAYOUTS), audio_conversations(tmp / "data")


def imported(tmp: Path, model_dir: Path, layouts: dict) -> Path:
    """`tmp`, where the model's import (ckpt) and the layout files <name>.yaml of `layouts` (name ->
    (processes, text)) now are."""
    _run_cli("import", "--model", model_dir, "--save", tmp / "ckpt")
    for name, (_, text) in layouts.items():
        (tmp / f"{name}.yaml").write_text(text)
    return tmp


def _run_cli(*args) -> str:
    """`python -m megatron_hetero.hf` with `args`, which must succeed: its output."""
    result = _cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_export_is_the_import(omni):
    """export gives the imported files back bit for bit: every tensor (the thinker's, the talker's,
    token2wav's), its dtype, with the tokenizer, chat template and processor files."""
    tmp, _ = omni
    _run_cli("export", "--load", tmp / "ckpt", "--out", tmp / "out")
    original, exported = _tensors(tmp / "hf"), _tensors(tmp / "out")
    assert exported.keys() == original.keys()
    assert {k.split(".")[0] for k in original} == {"thinker", "talker", "token2wav"}
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "config.json"):
        assert (tmp / "out" / name).read_bytes() == (tmp / "hf" / name).read_bytes(), name


def test_compare_one_process(omni):
    """Our forward (one process) against transformers' thinker on 7 samples: audio alone (resampled
    from 22.05 kHz stereo, from 8 kHz with a last chunk of 2 frames, two in a sample), an image and an
    audio, an image alone, text alone, a video with an audio, a video over the frame limit; the empty,
    corrupt and missing audio and the missing video skipped."""
    tmp, data = omni
    stdout = _run_cli(*_compare_args(tmp, data))
    per_sample, worst = _report(stdout, SAMPLES)
    print(stdout)
    assert len(per_sample) == SAMPLES and max(per_sample) == worst <= TOL
    assert stdout.count("(corrupt_audio)") == 2 and "(missing_audio)" in stdout and "(missing_video)" in stdout


def _tracks(tmp: Path, **data) -> tuple[Path, Path]:
    """The videos-with-audio data (track_conversations' `data` arguments) and a model.json that loads
    a video's own audio."""
    data = track_conversations(tmp / "tracks", **data)
    description = json.loads((tmp / "ckpt" / "model.json").read_text())
    description["processor"]["load_audio_from_video"] = True
    (tmp / "tracks_model.json").write_text(json.dumps(description))
    return data, tmp / "tracks_model.json"


def track_samples(omni: tuple[Path, Path], family: str, **data) -> tuple:
    """The videos-with-audio samples (_tracks) of the import loading a video's own audio: (its sizes,
    media processing, dataset, its tokens' letters: <|VIDEO|> V, <|AUDIO|> A, the vision start and
    end < >, the audio's ( ), a processor stand-in writing the same letters)."""
    from types import SimpleNamespace

    from megatron_hetero.data.chat import HFChatTokenizer
    from megatron_hetero.data.conversations import ConversationSamples, ConversationSpec
    from megatron_hetero.families import family_named
    from megatron_hetero.spec.sizes import sizes_from_dict

    tmp, _ = omni
    data, model_file = _tracks(tmp, **data)
    description = json.loads(model_file.read_text())
    sizes = sizes_from_dict(description["sizes"])
    media = family_named(family).media(sizes, description["processor"], description["hf"]["config"])
    dataset = ConversationSamples(ConversationSpec(str(data), str(data.parent), 512, media),
                                  HFChatTokenizer(str(tmp / "hf"), image_token=False), 1)
    names = {media.videos.pad: "V", media.audio_tokens.placeholder: "A", media.videos.start: "<",
             media.videos.end: ">", media.audio_tokens.prefix[0]: "(", media.audio_tokens.suffix[0]: ")"}
    processor = SimpleNamespace(audio_bos_token="(", audio_eos_token=")", video_token="V", audio_token="A",
                                video_processor=SimpleNamespace(merge_size=sizes.family_arch["spatial_merge_size"]))
    return sizes, media, dataset, names, processor


def test_video_with_its_audio_is_the_processors(omni):
    """load_audio_from_video: a video's tag expands as Qwen2_5OmniProcessor expands it (its
    replace_video_with_audio_token: the video's and its audio's tokens interleaved chunk by chunk of
    2 s), the video's own audio track an audio item of its own."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

    _, _, dataset, names, processor = track_samples(omni, "qwen2_5_omni")
    processor.get_chunked_index = lambda *args: Qwen2_5OmniProcessor.get_chunked_index(processor, *args)
    replace = partial(Qwen2_5OmniProcessor.replace_video_with_audio_token, processor, position_id_per_seconds=25,
                      seconds_per_chunk=2)
    for ours, theirs, (video, audio) in expansions(dataset, names, replace):
        assert ours == f"<{theirs}>" and theirs.count("A") == audio.items.rows[0] > 50, ours


def expansions(dataset, names: dict, replace):
    """Per sample 0 and 2 of track_samples' (a video with its own audio): our tokens in letters,
    the processor's expansion of the video's tag (replace(video inputs, 0, audio inputs, 0): its
    replace_video_with_audio_token) and the two media sources."""
    for index in (0, 2):
        sample, sources = dataset.encode(index)
        assert [(s.kind, s.tagged) for s in sources] == [("video", True), ("audio", False)]
        video, audio = (s.items for s in sources)
        theirs = replace({"video_grid_thw": [video.grids[0]], "video_second_per_grid": [video.seconds_per_grid]}, 0,
                         {"num_audio_tokens": [audio.rows[0]]}, 0)
        yield "".join(names.get(token, "") for token in sample.input_ids.tolist()), theirs, sources


@pytest.mark.families
def test_compare_video_with_its_audio(omni):
    """load_audio_from_video: a video with its own audio interleaved by time (alone, over several
    chunks, and beside an image and another audio) within 1e-4 of transformers' thinker run with
    use_audio_in_video."""
    tmp, _ = omni
    data, model_file = _tracks(tmp)
    stdout = _run_cli(*_compare_args(tmp, data, "--model-sizes", model_file, "--seq-length", 512))
    per_sample, worst = _report(stdout, 3)
    assert len(per_sample) == 3 and worst <= TOL, stdout


@pytest.mark.families
def test_transformers_names_round_trip(tmp_path):
    """The files in transformers 5's in-memory names (thinker.model.visual.*, ...) import and export
    back bit for bit."""
    src = qwen2_5_omni_dir(tmp_path / "hf")
    assert_round_trip({in_memory(key): tensor for key, tensor in _tensors(src).items()}, src, tmp_path)


def in_memory(key: str) -> str:
    """An omni thinker's file key in transformers 5's in-memory spelling."""
    renames = (("thinker.visual.", "thinker.model.visual."), ("thinker.audio_tower.", "thinker.model.audio_tower."),
               ("thinker.model.", "thinker.model.language_model."))
    return next((key.replace(a, b, 1) for a, b in renames if key.startswith(a)), key)


def assert_round_trip(tensors: dict[str, torch.Tensor], src: Path, tmp_path: Path) -> None:
    """`tensors` as the model directory `src`'s weights import and export back bit for bit."""
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    _run_cli("import", "--model", src, "--save", tmp_path / "ckpt")
    _run_cli("export", "--load", tmp_path / "ckpt", "--out", tmp_path / "out")
    exported = _tensors(tmp_path / "out")
    assert exported.keys() == tensors.keys() and all(torch.equal(exported[k], t) for k, t in tensors.items())


@pytest.mark.families
@pytest.mark.parametrize("layout", ["vdp2_adp2_ltp2", "vtp2_atp2", "vcp2_acp2_ltp2", "noncolocated"])
def test_compare_under_layouts(omni, tmp_path, layout):
    """`hf compare --hetero-layout`: vision DP2 and audio DP2 -> LLM TP2 colocated on 2 processes,
    both encoders at TP2 beside LLM DP2, both at CP2 (each image, video and audio split over the
    two) -> LLM TP2, and non-colocated on 3 (vision, audio, LLM): within 1e-4 on every sample."""
    compare_under(omni, tmp_path, layout, LAYOUTS[layout][0], SAMPLES)


def compare_under(omni: tuple[Path, Path], tmp_path: Path, layout: str, world: int, samples: int) -> None:
    """`hf compare` under the layout file <layout>.yaml of the import's directory on `world`
    processes: every one of `samples` samples within TOL."""
    tmp, data = omni
    code, text = collect_distributed(_compare_worker, world, tmp_path, str(tmp), str(data), [layout])[0][layout]
    print(layout, text.strip().splitlines()[-1] if text.strip() else text)
    per_sample, worst = _report(text, samples)
    assert code == 0 and len(per_sample) == samples and worst <= TOL, text


@pytest.fixture(scope="module")
def reference(omni):
    return train(*omni, "reference", "single", 1)


@pytest.mark.families
@pytest.mark.parametrize("layout", ["vdp2_adp2_ltp2", "vcp2_acp2_ltp2", "noncolocated"])
def test_training_equals_one_process(omni, reference, layout):
    """3 steps from the import (images and audio in the batches) under vision DP2 and audio DP2 ->
    LLM TP2 colocated, both encoders at CP2 -> LLM TP2, and non-colocated: loss and gradient norm per
    step within 1e-4 of one process's."""
    assert_same_steps(reference, train(*omni, layout, layout, LAYOUTS[layout][0]))


@pytest.mark.families
@pytest.mark.parametrize("modules, expected", [
    ("  vision: {role: encoder, dp: 4}\n  llm: {role: llm, tp: 2, dp: 2}\n",
     "a qwen2_5_omni model has an audio encoder: add a module `audio: {role: encoder}` and the edge audio -> llm"),
    ("  vision: {role: encoder, dp: 4}\n  audio: {role: encoder, dp: 2, pp: 2}\n  llm: {role: llm, tp: 2, dp: 2}\n",
     "module audio"),
])
def test_training_refusals(omni, tmp_path, modules, expected):
    """What a Qwen2.5-Omni model cannot train with: one `error:` line naming the layout's fix."""
    from tests.test_pretrain_errors import _run
    from tests.test_qwen2_5_vl import _train_flags

    edges = "edges: [vision -> llm, audio -> llm]\n" if "audio" in modules else ""
    result = _run(["--hetero-layout", "layout.yaml", *_train_flags(*omni)], tmp_path,
                  f"placement: colocated\n{edges}modules:\n{modules}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert expected in result.stderr.strip().splitlines()[-1], result.stderr[-500:]


def _audio_cp_worker(rank, world_size):
    """The audio encoder's rows and parameter gradients for audios of 37, 64 and 9 feature frames
    (chunks of 6 frames, 3 tokens: the rows' split falls inside a chunk; 19 tokens, an odd last one),
    whole on this rank and split over a CP group of every rank."""
    import torch.distributed as dist

    from megatron_hetero.families.qwen2_5_omni.audio import OmniAudioArch, OmniAudioEncoder
    from megatron_hetero.models.varlen import cp_owners
    from megatron_hetero.models.vlm import transformer_config
    from megatron_hetero.parallel import parallel_state
    from megatron_hetero.parallel.groups import build_module_groups
    from megatron_hetero.patches import cpu
    from megatron_hetero.spec.layout import ModuleLayout

    cpu.apply()
    whole_pgs = build_module_groups(ModuleLayout("audio", "encoder", dp=world_size)).pgs
    cp_pgs = build_module_groups(ModuleLayout("audio", "encoder", cp=world_size)).pgs
    parallel_state.init_outside_training(0, tp_rank=0)
    arch = OmniAudioArch(audio_ffn_hidden_size=48, audio_n_window=3, audio_max_source_positions=16,
                         audio_output_dim=24)
    config = transformer_config(32, 2, 4, 1, torch.float64, arch=arch.transformer_arch())
    whole, split = (OmniAudioEncoder(config, arch, 16, pgs) for pgs in (whole_pgs, cp_pgs))
    split.load_state_dict(whole.state_dict())
    frames = torch.tensor([37, 64, 9])
    g = torch.Generator().manual_seed(0)
    features = torch.randn(int(frames.sum()), 16, generator=g, dtype=torch.float64)
    grids = torch.stack([torch.ones_like(frames), torch.ones_like(frames), frames], 1)
    mine = cp_owners(((frames - 1) // 2 + 1 - 2) // 2 + 1, world_size) == rank  # this rank's rows (the boundary's)
    rows = {name: model(features, grids) for name, model in (("whole", whole), ("split", split))}
    weights = torch.randn(rows["whole"].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (rows["whole"] * weights).sum().backward()
    (rows["split"] * weights[mine]).sum().backward()
    grads = [p.grad.clone() for p in split.parameters()]
    for grad in grads:
        dist.all_reduce(grad, group=cp_pgs.cp)
    return dict(rows=(rows["split"].detach(), rows["whole"].detach()[mine]),
                grads=(grads, [p.grad for p in whole.parameters()]))


def test_audio_encoder_cp_is_the_whole_encoder(tmp_path):
    """Audio encoder CP2 (each audio split by rows over 2 processes, each chunk's keys gathered) gives
    each rank the whole encoder's rows of its part, and the ranks' gradients sum to the whole one's."""
    for rank, result in enumerate(collect_distributed(_audio_cp_worker, 2, tmp_path)):
        torch.testing.assert_close(*result["rows"], rtol=1e-10, atol=1e-10)
        for got, want in zip(*result["grads"]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
