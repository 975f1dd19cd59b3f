"""Bad input to the pretrain script: one `error:` line naming the flag or field, exit 2, no traceback."""

import os
from pathlib import Path

import pytest

from tests.distributed import run_python

ROOT = Path(__file__).parent.parent
DEMO = str(ROOT / "examples" / "layouts" / "demo_colocated.yaml")
MOE_EP2 = str(ROOT / "examples" / "layouts" / "moe_colocated_vdp4_ldp4ep2.yaml")


def _run(args, tmp_path, layout_text=None):
    if layout_text is not None:
        (tmp_path / "layout.yaml").write_text(layout_text)
    env = dict(os.environ, WORLD_SIZE="4", RANK="0", PYTHONWARNINGS="ignore")
    return run_python([ROOT / "examples" / "pretrain_vlm.py", *args], env=env, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("args, layout_text, expected", [
    (["--hetero-layout", "layout.yaml"],
     "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4}\n  llm: {role: llm, pp: 4}\n",
     "module llm: pp=4 is more pipeline stages than --num-layers 2; use pp <= 2"),
    (["--hetero-layout", "layout.yaml", "--num-layers", "3"],
     "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4}\n  llm: {role: llm, dp: 2, pp: 2}\n",
     "--num-layers 3 is not divisible by module llm's pp=2"),
    (["--hetero-layout", "layout.yaml", "--seq-length", "30"],
     "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4}\n  llm: {role: llm, tp: 2, cp: 2}\n",
     "--seq-length 30 is not divisible by 2 x the llm's cp = 4"),
    (["--hetero-layout", "layout.yaml"],
     "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2, pp: 2}\n  llm: {role: llm, tp: 4}\n",
     "module vision: a colocated encoder runs unpipelined"),
    (["--hetero-layout", "layout.yaml"],
     "placement: colocated\nmodules:\n  image: {role: encoder, dp: 4}\n  llm: {role: llm, tp: 4}\n",
     "module image: kind 'image' is not an encoder this model builds; set kind: to one of vision, audio"),
    (["--hetero-layout", "layout.yaml", "--audio-frames", "30"],
     "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4}\n  audio: {role: encoder, dp: 4}\n"
     "  llm: {role: llm, tp: 4}\nedges: [vision -> llm, audio -> llm]\n",
     "--audio-frames 30 is not a positive multiple of 4"),
    (["--hetero-layout", "layout.yaml"],
     "placement: colocated\nmodules:\n  vision: {role: encoder, tp: 2, on_first_stage: true}\n"
     "  llm: {role: llm, dp: 2, pp: 2}\n",
     "module vision: on_first_stage takes the llm's first-stage layout (Megatron's), got tp=2 cp=1 dp=1 pp=1; "
     "set tp: 1, cp: 1, dp: 2, pp: 1"),
    (["--hetero-layout", "missing.yaml"], None, "missing.yaml"),
    (["--hetero-layout", DEMO, "--global-batch-size", "6"], None, "--global-batch-size 6"),
    (["--hetero-layout", DEMO, "--eval-samples", "3"], None, "--eval-samples 3"),
    (["--hetero-layout", DEMO, "--num-attention-heads", "3"], None, "--num-attention-heads 3"),
    (["--hetero-layout", DEMO, "--num-attention-heads", "1", "--hidden-size", "64"], None, "tp=2"),
    (["--hetero-layout", DEMO, "--patch-size", "5"], None, "--patch-size 5"),
    (["--hetero-layout", DEMO, "--seq-length", "20"], None, "use --seq-length"),
    (["--hetero-layout", DEMO, "--bf16"], None, "--bf16 needs GPUs"),
    (["--hetero-layout", DEMO, "--attention-backend", "flash"], None,
     "module llm: --attention-backend flash: head dim 16: no GPU; or use --attention-backend auto"),
    (["--hetero-layout", DEMO, "--attention-backend", "local"], None, "use --attention-backend unfused"),
    (["--hetero-layout", DEMO, "--data-path", "a.txt"], None,
     "--data-path a.txt: give one conversation .json or .jsonl file"),
    (["--hetero-layout", DEMO, "--data-path", str(ROOT / "examples")], None,
     "a directory without .nv-meta/, not a prepared energon dataset; run `energon prepare"),
    (["--hetero-layout", DEMO, "--data-path", "a.json", "--tokenizer-type", "HuggingFaceTokenizer",
      "--tokenizer-model", "nowhere"], None, "--tokenizer-model nowhere: nowhere is not a Hugging Face tokenizer"),
    # MoE: expert layouts against Megatron's flags
    (["--hetero-layout", MOE_EP2], None, "module llm: ep=2 etp=1 lay out experts but the llm is dense"),
    (["--hetero-layout", MOE_EP2, "--num-experts", "5"], None, "--num-experts 5 is not divisible by module llm's ep=2"),
    (["--hetero-layout", MOE_EP2, "--num-experts", "4", "--expert-model-parallel-size", "4"], None,
     "--expert-model-parallel-size 4 conflicts with module llm's ep=2"),
    (["--hetero-layout", DEMO, "--num-experts", "4"], None, "an MoE llm with tp=2 needs sequence parallelism"),
    (["--hetero-layout", DEMO, "--save", "ckpt", "--ckpt-format", "torch"], None,
     "--ckpt-format torch is not supported with --hetero-layout; use --ckpt-format torch_dist"),
    (["--hetero-layout", DEMO, "--async-save"], None, "--async-save is not supported"),
    (["--hetero-layout", DEMO, "--hetero-colocated-schedule", "bubbles"], None,
     "--hetero-colocated-schedule bubbles applies to colocated layouts with llm pp > 1 (this one: colocated, pp 1)"),
    (["--hetero-layout", DEMO, "--non-persistent-save-interval", "5"], None, "--non-persistent-save-interval"),
    # an encoder's pass over k llm microbatches: whole passes, the recompute schedule under llm pp > 1
    (["--hetero-layout", "layout.yaml", "--micro-batch-size", "1"],
     "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4, microbatches: 3}\n  llm: {role: llm, tp: 4}\n",
     "module vision: microbatches: 3 does not divide the step's 32 llm microbatches"),
    (["--hetero-layout", "layout.yaml", "--hetero-colocated-schedule", "three-phase"],
     "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4, microbatches: 2}\n"
     "  llm: {role: llm, dp: 2, pp: 2}\n",
     "module vision: microbatches: 2 runs under the recompute schedule, not --hetero-colocated-schedule three-phase"),
    # an encoder's CP splits an item's tokens: 16 patches do not split over cp 3
    (["--hetero-layout", "layout.yaml"],
     "placement: non_colocated\nmodules:\n  vision: {role: encoder, cp: 3, ranks: 0-2}\n"
     "  llm: {role: llm, ranks: 3-3}\n",
     "module vision: cp=3 does not divide an item's 16 encoder tokens (--image-size / --patch-size); set cp: to "
     "a divisor (1, 2, 4, 8, 16)"),
    (["--hetero-layout", "layout.yaml", "--audio-frames", "8"],
     "placement: colocated\nmodules:\n  vision: {role: encoder, dp: 4}\n  audio: {role: encoder, cp: 4}\n"
     "  llm: {role: llm, tp: 4}\nedges: [vision -> llm, audio -> llm]\n",
     "module audio: cp=4 does not divide an item's 2 encoder tokens (--audio-frames / 4)"),
    (["--hetero-layout", str(ROOT / "examples" / "layouts" / "non_colocated_1_3.yaml"),
      "--global-batch-size", "10", "--micro-batch-size", "1"], None, "use a multiple of 3"),
    (["--hetero-layout", str(ROOT / "examples" / "layouts" / "non_colocated_2_2.yaml"),
      "--images-per-sample", "3-1"], None, "--images-per-sample 3-1: give a count N or a range A-B"),
    (["--hetero-layout", str(ROOT / "examples" / "layouts" / "non_colocated_2_2.yaml"),
      "--images-per-sample", "4"], None, "--seq-length 32 cannot hold <bos>, 64 image/audio tokens"),
    (["--hetero-layout", str(ROOT / "examples" / "layouts" / "non_colocated_2_2.yaml"),
      "--pack-samples", "3", "--micro-batch-size", "2"], None,
     "--micro-batch-size 2 is not a multiple of --pack-samples 3"),
    (["--hetero-layout", str(ROOT / "examples" / "layouts" / "non_colocated_2_2.yaml"),
      "--pack-samples", "2"], None, "caption and <eos> 2 times (--pack-samples 2); use --seq-length"),
])
def test_bad_input_is_one_line(tmp_path, args, layout_text, expected):
    _assert_one_line(_run(args, tmp_path, layout_text), expected)


@pytest.mark.parametrize("env", ["MEGATRON_HETERO_NORM_KERNEL", "MEGATRON_HETERO_MLP_KERNEL"])
def test_bad_kernel_mode_is_one_line(tmp_path, monkeypatch, env):
    monkeypatch.setenv(env, "apex")
    _assert_one_line(_run(["--hetero-layout", DEMO], tmp_path), f"{env}=apex: use one of auto, torch, quack")


def _assert_one_line(result, expected):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_argument_file(tmp_path):
    """`@file` works for every flag, several per line, with comments."""
    (tmp_path / "args.txt").write_text(f"--hetero-layout {DEMO}  # the layout\n--global-batch-size 6\n")
    result = _run(["@args.txt"], tmp_path)
    assert result.returncode == 2 and "--global-batch-size 6" in result.stderr
