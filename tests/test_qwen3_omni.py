"""Qwen3-Omni (megatron_hetero/families/qwen3_omni) from a tiny random transformers model built offline
(tests/omni_fixtures.py: the thinker with DeepStack and 4 experts, the talker with its code
predictor, code2wav): import -> export is bit-identical with every tensor of the files (the talker
and code2wav passed through); our forward equals transformers' thinker's (logits within 1e-4 fp32,
`hf compare`) on samples with audio (over several chunks and attention windows, resampled, stereo,
one shorter than a chunk, two in a sample), an image and audio together, an image alone, text alone,
videos, the bad audio skipped; what the family refuses. Under the `families` marker: a video's tag
with its own audio and an audio's features and rows are Qwen3OmniMoeProcessor's; a video's own
audio merged by time against the thinker's use_audio_in_video; the same comparison under layouts
(vision DP2 and audio DP2 -> LLM TP2, vision CP2 on the videos, LLM EP2, non-colocated) and 3
training steps under them equal to one process's; the transformers-names round trip."""

from functools import partial

import pytest
import torch

from tests.omni_fixtures import QWEN3_AUDIO_FILES, qwen3_audio_conversations, qwen3_omni_dir
from tests.test_qwen2_5_omni import (
    _run_cli,
    _tensors,
    _tracks,
    assert_round_trip,
    compare_under,
    expansions,
    imported,
    in_memory,
    track_samples,
)
from tests.test_qwen2_5_vl import _compare_args, _report, assert_same_steps, train

TOL = 1e-4
SAMPLES = 8  # the usable samples of the audio data
_C, _E = "placement: colocated\n", "edges: [vision -> llm, audio -> llm]\nmodules:\n"
# name -> (processes, layout)
LAYOUTS = {
    "single": (1, _C + _E + "  vision: {role: encoder}\n  audio: {role: encoder}\n  llm: {role: llm}\n"),
    "vdp2_adp2_ltp2": (2, _C + _E + "  vision: {role: encoder, dp: 2}\n  audio: {role: encoder, dp: 2}\n"
                                    "  llm: {role: llm, tp: 2, sp: true}\n"),
    # each video's and image's merge blocks split over vision CP2, DeepStack rows with them
    "vcp2_adp2_ltp2": (2, _C + _E + "  vision: {role: encoder, cp: 2}\n  audio: {role: encoder, dp: 2}\n"
                                    "  llm: {role: llm, tp: 2, sp: true}\n"),
    # the second DeepStack block crosses the LLM's stage boundary beside the audio's rows
    "lpp2": (2, _C + _E + "  vision: {role: encoder, dp: 2}\n  audio: {role: encoder, dp: 2}\n"
                          "  llm: {role: llm, pp: 2}\n"),
    "lep2": (2, _C + _E + "  vision: {role: encoder, tp: 2}\n  audio: {role: encoder, tp: 2}\n"
                          "  llm: {role: llm, dp: 2, ep: 2}\n"),
    "noncolocated": (3, "placement: non_colocated\n" + _E + "  vision: {role: encoder, ranks: 0-0}\n"
                        "  audio: {role: encoder, ranks: 1-1}\n  llm: {role: llm, ranks: 2-2}\n"),
}


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """The model directory, its audio conversation data and its import."""
    tmp = tmp_path_factory.mktemp("qwen3_omni")
    return imported(tmp, qwen3_omni_dir(tmp / "hf"), LAYOUTS), qwen3_audio_conversations(tmp / "data")


def test_export_is_the_import(omni):
    """export gives the imported files back bit for bit: every tensor (the thinker's with one tensor
    per expert, the talker's and its code predictor's, code2wav's), its dtype, with the tokenizer,
    chat template and processor files."""
    tmp, _ = omni
    _run_cli("export", "--load", tmp / "ckpt", "--out", tmp / "out")
    original, exported = _tensors(tmp / "hf"), _tensors(tmp / "out")
    assert exported.keys() == original.keys()
    assert {k.split(".")[0] for k in original} == {"thinker", "talker", "code2wav"}
    assert any(".talker.code_predictor." in f".{k}" for k in original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "video_preprocessor_config.json", "config.json"):
        assert (tmp / "out" / name).read_bytes() == (tmp / "hf" / name).read_bytes(), name


def test_compare_one_process(omni):
    """Our forward (one process) against transformers' thinker on 8 samples: audio over 3 chunks and
    2 attention windows (from 22.05 kHz stereo), an image and an audio, two audios, an audio shorter
    than one chunk, an image alone, text alone, a video with an audio (DeepStack rows at the video's
    positions, none at the audio's), a video over the frame limit; the empty and corrupt audio
    skipped."""
    tmp, data = omni
    stdout = _run_cli(*_compare_args(tmp, data))
    per_sample, worst = _report(stdout, SAMPLES)
    print(stdout)
    assert len(per_sample) == SAMPLES and max(per_sample) == worst <= TOL
    assert stdout.count("(corrupt_audio)") == 2


@pytest.mark.families
def test_media_are_the_processors(omni):
    """load_audio_from_video: a video's tag expands as Qwen3OmniMoeProcessor expands it (its
    replace_video_with_audio_token: the video's and its audio's tokens merged by time), the video's
    own audio an audio item whose features and rows are the processor's (_process_audio with its
    audio_kwargs: the whole audio, no 30 s cap)."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    from megatron_hetero.data.audio import read_audio

    sizes, media, dataset, names, processor = track_samples(omni, "qwen3_omni_moe", tone=QWEN3_AUDIO_FILES["tone.wav"])
    processor.feature_extractor, processor.n_window = media.extractor, sizes.family_arch["audio_n_window"]
    processor.replace_audio_token = lambda *args, **kw: Qwen3OmniMoeProcessor.replace_audio_token(processor, *args,
                                                                                                  **kw)
    replace = partial(Qwen3OmniMoeProcessor.replace_video_with_audio_token, processor, position_id_per_seconds=13)
    for ours, theirs, (_, audio) in expansions(dataset, names, replace):
        assert ours == f"<{theirs}>" and theirs.count("A") == audio.items.rows[0] and "AV" in theirs, ours
        waveform = read_audio(str(audio.source), media.extractor.sampling_rate)
        features, _ = Qwen3OmniMoeProcessor._process_audio(processor, [waveform], **Qwen3OmniMoeProcessor.audio_kwargs)
        frames = int(features["feature_attention_mask"].sum())
        assert audio.items.grids[0][2] == frames and audio.items.rows[0] == int(features["num_audio_tokens"][0])
        assert torch.equal(media.audio_pixels(str(audio.source), audio.items),
                           torch.from_numpy(features["input_features"][0, :, :frames].T))


@pytest.mark.families
def test_compare_video_with_its_audio(omni):
    """load_audio_from_video: a video with its own audio merged by time (alone, over several windows,
    and beside an image and another audio) within 1e-4 of transformers' thinker run with
    use_audio_in_video."""
    tmp, _ = omni
    data, model_file = _tracks(tmp, tone=QWEN3_AUDIO_FILES["tone.wav"])
    stdout = _run_cli(*_compare_args(tmp, data, "--model-sizes", model_file, "--seq-length", 512))
    per_sample, worst = _report(stdout, 3)
    assert len(per_sample) == 3 and worst <= TOL, stdout


@pytest.mark.families
def test_transformers_names_round_trip(omni, tmp_path):
    """The thinker's files in transformers 5's in-memory names (thinker.model.visual.*, ..., each
    layer's experts fused) import and export back bit for bit."""
    tmp, _ = omni
    src = tmp_path / "hf"
    src.mkdir()
    for f in (tmp / "hf").iterdir():
        if not f.name.endswith(".safetensors"):
            (src / f.name).write_bytes(f.read_bytes())
    tensors, experts = {}, {}
    for key, tensor in _tensors(tmp / "hf").items():
        key = in_memory(key)
        layer, dot, rest = key.partition(".mlp.experts.")
        if dot and key.startswith("thinker."):
            expert, _, name = rest.partition(".")
            experts.setdefault(layer, {}).setdefault(name, {})[int(expert)] = tensor
        else:
            tensors[key] = tensor
    for layer, parts in experts.items():
        stack = {name: torch.stack([parts[name][e] for e in sorted(parts[name])]) for name in parts}
        gate_up = torch.cat([stack["gate_proj.weight"], stack["up_proj.weight"]], 1)
        tensors[f"{layer}.mlp.experts.gate_up_proj"] = gate_up
        tensors[f"{layer}.mlp.experts.down_proj"] = stack["down_proj.weight"]
    assert_round_trip(tensors, src, tmp_path)


@pytest.mark.families
@pytest.mark.parametrize("layout", ["vdp2_adp2_ltp2", "vcp2_adp2_ltp2", "lpp2", "lep2", "noncolocated"])
def test_compare_under_layouts(omni, tmp_path, layout):
    """`hf compare --hetero-layout`: vision DP2 and audio DP2 -> LLM TP2, vision CP2 (each video's and
    image's merge blocks split) beside audio DP2 -> LLM TP2, both encoders at DP2 -> LLM PP2 (the
    second DeepStack block's rows cross the stage boundary), both encoders at TP2 -> LLM EP2, and
    non-colocated on 3 processes (vision, audio, LLM): within 1e-4 on every sample."""
    compare_under(omni, tmp_path, layout, LAYOUTS[layout][0], SAMPLES)


@pytest.fixture(scope="module")
def reference(omni):
    return train(*omni, "reference", "single", 1)


@pytest.mark.families
@pytest.mark.parametrize("layout", ["vdp2_adp2_ltp2", "vcp2_adp2_ltp2", "lep2", "noncolocated"])
def test_training_equals_one_process(omni, reference, layout):
    """3 steps from the import (images, videos and audio in the batches) under vision DP2 and audio
    DP2 -> LLM TP2, vision CP2, LLM EP2 and non-colocated: loss and gradient norm per step within
    1e-4 of one process's."""
    assert_same_steps(reference, train(*omni, layout, layout, LAYOUTS[layout][0]))


class _Vocabulary(list):
    """A stand-in tokenizer: token ids by position."""

    def convert_tokens_to_ids(self, token):
        return self.index(token)


@pytest.mark.parametrize("change, expected", [
    (("audio_config", "n_window", 40), "thinker_config.audio_config.n_window = 40 is not supported"),
    (("text_config", "norm_topk_prob", False), "thinker_config.text_config.norm_topk_prob = False is not supported"),
    (("text_config", "mlp_only_layers", [1]), "thinker_config.text_config.mlp_only_layers = [1] is not supported"),
])
def test_config_refusals(change, expected):
    """What the family does not map: one line naming the config field."""
    from megatron_hetero.convert.rules import HFMappingError
    from megatron_hetero.families import family_named
    from tests.omni_fixtures import QWEN3_OMNI_SPECIALS, qwen3_omni_config

    config = qwen3_omni_config(_Vocabulary(QWEN3_OMNI_SPECIALS))
    family = family_named("qwen3_omni_moe")
    family.sizes(config)  # as built: maps
    sub, field, value = change
    setattr(getattr(config.thinker_config, sub), field, value)
    with pytest.raises(HFMappingError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        family.sizes(config)


def test_video_fps_refusal():
    """A video fps whose temporal step (temporal_patch_size / fps x position_id_per_seconds) is not a
    whole number of position ids: one line naming the fix."""
    from megatron_hetero.convert.rules import HFMappingError
    from megatron_hetero.families.qwen2_5_vl.video import VideoSettings
    from megatron_hetero.families.qwen3_omni.media import Qwen3OmniVideos

    ids = {"video_token_id": 1, "vision_start_token_id": 2, "vision_end_token_id": 3, "position_id_per_seconds": 13}
    assert Qwen3OmniVideos(VideoSettings(fps=2), ids).seconds_per_grid == 1.0
    assert Qwen3OmniVideos(VideoSettings(), ids).seconds_per_grid == 2.0  # the processor's default fps, 1
    with pytest.raises(HFMappingError, match="fps 3 gives temporal position ids 8.66667 apart"):
        Qwen3OmniVideos(VideoSettings(fps=3), ids)
