"""`megatron-hetero`, the one command: its subcommands, their `--help`, `layout show`'s process
groups, `layout check --model-sizes` refusing what training refuses, the planner's Megatron flag
names (old names as deprecated aliases) and its calibration by GPU model, printed."""

import json
import re
import sys
from pathlib import Path

import pytest

from megatron_hetero.cli.main import COMMANDS, main
from megatron_hetero.spec.sizes import LLMArch, ModelSizes, MoEArch, sizes_to_dict
from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "examples" / "layouts" / "demo_colocated.yaml")


def test_usage_lists_every_command(capsys):
    assert main(["--help"]) == 0
    printed = capsys.readouterr().out
    assert all(f"  {name}" in printed for name in COMMANDS)
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("megatron-hetero 0.")
    assert main(["trian"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown command 'trian'; commands: layout, plan")
    assert main([]) == 2


def test_every_usage_line_names_every_kernel_check():
    """The hand-written `kernels check [a|b|...]` lines (both commands' usage, the commands reference)
    name exactly the checks `kernels check` runs."""
    from megatron_hetero.cli import kernels
    from megatron_hetero.cli import main as main_module

    texts = [main_module.__doc__, kernels.__doc__, (ROOT / "docs" / "reference" / "commands.md").read_text()]
    for text in texts:
        (names,) = re.findall(r"kernels check \[([a-z|\\-]+)\]", text)
        assert names.replace("\\", "").split("|") == [*kernels.CHECKS, "all"]


@pytest.mark.parametrize("command", [["layout", "check"], ["layout", "show"], ["plan"], ["verify"], ["hf", "import"],
                                     ["hf", "compare"], ["hf", "export"], ["launch"], ["breakdown"],
                                     ["kernels", "check"]])
def test_every_command_has_help(command):
    """`megatron-hetero ... --help` exits 0 and names itself; every option it lists has a help text."""
    result = run_python(["-m", "megatron_hetero.cli", *command, "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"usage: megatron-hetero {' '.join(command)}" in result.stdout
    assert not _without_help(result.stdout), f"options without a help text: {_without_help(result.stdout)}"


@pytest.mark.parametrize("command", [["megatron_hetero.cli", "hf", "export", "--load", "missing", "--out", "out"],
                                     ["megatron_hetero.hf", "export", "--load", "missing", "--out", "out"],
                                     ["megatron_hetero.cli", "verify", "missing.yaml"]])
def test_a_command_prints_no_missing_accelerator_warnings(command, tmp_path):
    """Commands that import megatron-core, in a fresh interpreter as a user runs them (each stops at
    its missing file): megatron-core's "Transformer Engine and Apex are not installed" warnings, one
    per importing module, are dropped before it is imported."""
    import subprocess

    result = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines()[-1].startswith("error: "), result.stderr
    assert "are not installed" not in result.stderr and "Warning" not in result.stderr, result.stderr


def _without_help(text: str) -> list[str]:
    """argparse's option lines with no help: neither text after the option on its line nor an
    indented line under it."""
    lines = text.split("options:", 1)[-1].splitlines() + [""]
    return [line.strip() for line, after in zip(lines, lines[1:])
            if line.startswith("  -") and "  " not in line.strip() and not after.startswith(" " * 8)]


@pytest.mark.parametrize("what", ["attention", "all"])
def test_kernels_check_without_a_gpu_is_one_line(capsys, monkeypatch, what):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["kernels", "check", what]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.startswith("error: no GPU visible") and printed.err.count("\n") == 1


def test_kernels_check_without_the_kernels_is_one_line(capsys, monkeypatch, tmp_path):
    """On a GPU where flash-attn-4 or quack does not import: each check says so in one line, exit 2
    (after, in a process without Transformer Engine, the package's one start-up note)."""
    from megatron_hetero.cli.checks import attention, mlp, norms
    from megatron_hetero.models.attention_kernels import Device

    monkeypatch.setattr(attention, "current_device", lambda: Device("NVIDIA B200", (10, 0)))
    monkeypatch.setattr(attention, "load_fa4", lambda: (None, "flash-attn-4 is not installed"))
    monkeypatch.setattr(norms, "load_quack", lambda: (None, "quack is not installed"))
    monkeypatch.setattr(mlp, "load_quack_gemm", lambda: (None, "quack is not installed"))
    for check, args in ((attention, (False, tmp_path, True, False)), (norms, (False, tmp_path)),
                        (mlp, (False, tmp_path))):
        assert check.main(*args) == 2
        printed = capsys.readouterr().out.splitlines()
        assert printed[-1] == f"error: {'flash-attn-4' if check is attention else 'quack'} is not installed"
        assert all(line.startswith("megatron-hetero: ") for line in printed[:-1]), printed


def test_launch_help_describes_itself(capsys):
    from megatron_hetero.launch import main as launch

    assert launch(["--help"], prog="megatron-hetero launch") == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: megatron-hetero launch SCRIPT.py") and "--no-python" in printed
    assert launch([], prog="megatron-hetero launch") == 2


def test_layout_show_lists_the_groups(capsys):
    assert main(["layout", "show", DEMO, "--world-size", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "rank 3: vision[tp0 cp0 dp3 pp0] llm[tp1 cp0 dp1 pp0]" in lines
    assert lines[-3:] == ["vision dp groups: [0,1,2,3]", "llm tp groups: [0,1] [2,3]", "llm dp groups: [0,2] [1,3]"]


def _model_json(tmp_path, **sizes) -> str:
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"sizes": sizes_to_dict(ModelSizes(**sizes))}))
    return str(path)


@pytest.mark.parametrize("modules, sizes, error", [
    ("  video: {role: encoder, dp: 2}\n  llm: {role: llm, tp: 2}\n", {},
     "module video: kind 'video' is not an encoder this model builds; set kind: to one of vision, audio"),
    ("  vision: {role: encoder, tp: 2}\n  llm: {role: llm, dp: 2}\n", {"enc_num_attention_heads": 3},
     "model.json's enc_num_attention_heads 3 is not divisible by module vision's tp=2"),
    ("  vision: {role: encoder, dp: 2}\n  llm: {role: llm, tp: 2}\n", {"num_attention_heads": 5, "hidden_size": 80},
     "model.json's num_attention_heads 5 is not divisible by module llm's tp=2"),
    ("  vision: {role: encoder, cp: 2}\n  llm: {role: llm, cp: 2}\n", {"image_size": 24, "patch_size": 8},
     "module vision: cp=2 does not divide an item's 9 encoder tokens"),
    ("  vision: {role: encoder, dp: 2}\n  llm: {role: llm, pp: 2}\n", {"num_layers": 3},
     "model.json's num_layers 3 is not divisible by module llm's pp=2"),
    ("  vision: {role: encoder, dp: 2}\n  llm: {role: llm, tp: 2}\n", {"llm_arch": LLMArch(moe=MoEArch(num_experts=4))},
     "module llm: an MoE llm with tp=2 needs sequence parallelism (megatron-core's MoE layer); set sp: true"),
    ("  vision: {role: encoder, dp: 2}\n  llm: {role: llm, tp: 2}\n", {"family": "qwen9_vl"},
     "model family 'qwen9_vl' is not one this version maps"),
])
def test_layout_check_with_model_sizes_refuses_what_training_refuses(tmp_path, capsys, modules, sizes, error):
    """The same layout passes without --model-sizes (the boundary serves it) and is one error line with it."""
    layout = tmp_path / "layout.yaml"
    layout.write_text("placement: colocated\nmodules:\n" + modules)
    assert main(["layout", "check", str(layout), "--world-size", "2"]) == 0
    capsys.readouterr()
    model = _model_json(tmp_path, **sizes)
    assert main(["layout", "check", str(layout), "--world-size", "2", "--model-sizes", model]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and error in err and err.count("\n") == 1, err
    layout.write_text("placement: colocated\nmodules:\n  vision: {role: encoder, dp: 2}\n  llm: {role: llm, tp: 2}\n")
    assert main(["layout", "check", str(layout), "--world-size", "2", "--model-sizes", _model_json(tmp_path)]) == 0


@pytest.mark.parametrize("text, error", [(None, "cannot read it: No such file or directory"),
                                         ("{", "not valid JSON: line 1: Expecting property name"),
                                         ("{}", "it holds no `sizes` object"),
                                         ('{"sizes": {"vision_arch": {"patch": 14}}}', "sizes: VisionArch")])
def test_a_model_json_that_is_not_one_is_one_line(tmp_path, capsys, text, error):
    """`layout check --model-sizes` (and training's --model-sizes, the same reader) on a file that is
    not hf import's model.json: one line saying what is wrong with it."""
    model = tmp_path / "model.json"
    if text is not None:
        model.write_text(text)
    assert main(["layout", "check", DEMO, "--world-size", "4", "--model-sizes", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model-sizes {model}: {error}") and err.count("\n") == 1, err
    assert err.endswith("; give the model.json of hf import\n")


def test_plan_takes_megatrons_flag_names_and_the_gpus_measured_calibration(capsys):
    args = ["plan", "--workload", "tiny", "--gpus", "2", "--top", "1"]
    assert main([*args, "--global-batch-size", "8", "--micro-batch-size", "1"]) == 0
    new = capsys.readouterr()
    assert new.err == "" and "calibration: calibration_h200_measured.json, measured on the H200" in new.out
    assert main([*args, "--global-batch", "8", "--micro-batch", "1"]) == 0
    old = capsys.readouterr()
    assert old.err.splitlines() == ["warning: --global-batch is deprecated; use --global-batch-size",
                                    "warning: --micro-batch is deprecated; use --micro-batch-size"]
    assert old.out == new.out
    assert main([*args, "--gpu", "h100"]) == 0
    h100 = capsys.readouterr().out
    assert "85 GB each" in h100 and "calibration: calibration_h100_measured.json, measured on the H100 (named" in h100
    assert main([*args, "--calibration", "h200"]) == 0
    assert "calibration: calibration_h200.json, given by --calibration" in capsys.readouterr().out


def test_plan_counts_the_gated_vit_mlp_fused_where_its_check_passed(capsys):
    """`--fused-gated-bias-mlp` (Qwen2.5-VL's ViT MLP with fc1 biases on quack's epilogues) keeps one
    ffn-wide tensor less per ViT token and layer: the one-GPU layout's memory drops, its time stays."""
    args = ["plan", "--workload", "qwen2_5_vl_7b", "--gpus", "1", "--gpu", "h200", "--llm-layers", "4", "--top", "1",
            "--fused-mlp"]
    rows = []
    for extra in ([], ["--fused-gated-bias-mlp"]):
        assert main([*args, *extra]) == 0
        out = capsys.readouterr().out
        rows.append(out.split("best 1:")[1].splitlines()[2].split())
    assert rows[0][:-1] == rows[1][:-1] and int(rows[1][-1]) < int(rows[0][-1]) - 4  # GB/GPU: ~5.7 GB less


def test_layout_show_draws_a_png(tmp_path, capsys):
    """--png draws every rank of every module in its data-parallel colour; without matplotlib, one line."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    png = tmp_path / "layout.png"
    assert main(["layout", "show", DEMO, "--world-size", "4", "--png", str(png)]) == 0
    image = Image.open(png).convert("RGB")
    colours = {colour for count, colour in image.getcolors(1 << 20) if count > 2000}  # the cells' fills
    assert image.width > 600 and len(colours) >= 5, colours  # white, and dp 0-3 of the encoder (llm dp 0-1 among them)


def test_layout_show_png_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["layout", "show", DEMO, "--world-size", "4", "--png", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err == "error: --png needs matplotlib: pip install 'megatron-hetero[plot]' (or matplotlib)\n"


@pytest.mark.parametrize("command", [["layout", "show", DEMO, "--world-size", "4"],
                                     ["breakdown", str(ROOT / "docs" / "runs" / "bench_e2e" /
                                                       "w1_layouts_h200x2_bench_e2e.jsonl")]])
def test_a_png_that_cannot_be_written_is_one_line(tmp_path, capsys, command):
    pytest.importorskip("matplotlib")
    png = tmp_path / "missing" / "x.png"
    assert main([*command, "--png", str(png)]) == 2
    assert capsys.readouterr().err == f"error: --png {png}: cannot write it: No such file or directory\n"


def test_every_flag_of_ours_has_help():
    """`examples/pretrain_vlm.py --help`: every flag of megatron-hetero's groups (those every script
    gets and the example's own) has a help text."""
    result = run_python([ROOT / "examples" / "pretrain_vlm.py", "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    ours = result.stdout.split("\nmegatron-hetero:")[1]
    assert "megatron-hetero example:" in ours
    assert not _without_help(f"options:{ours}"), _without_help(f"options:{ours}")


def test_breakdown_draws_a_records_step(tmp_path, capsys):
    """`breakdown` draws a committed bench_e2e record (one bar per rank); a record without per-rank
    phases is one error line."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    records = ROOT / "docs" / "runs" / "bench_e2e" / "w1_layouts_h200x2_bench_e2e.jsonl"
    png = tmp_path / "step.png"
    assert main(["breakdown", str(records), "--record", "5", "--png", str(png)]) == 0
    assert Image.open(png).width > 600
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"workload": "W1"}\n')
    assert main(["breakdown", str(bad), "--png", str(png)]) == 2
    assert capsys.readouterr().err.endswith("the record has no per-rank phases (`ranks`): give a record of "
                                            "benchmarks/bench_e2e.py\n")
    for text, error in (("", "no records"), ('{"ranks": []}\n[1]\n', "line 2 is not a JSON object"),
                        ("step 1\n", "line 1 is not a JSON object")):
        bad.write_text(text)
        assert main(["breakdown", str(bad), "--png", str(png)]) == 2
        assert capsys.readouterr().err == f"error: {bad}: {error}; give a file benchmarks/bench_e2e.py wrote\n"
    assert main(["breakdown", str(records), "--record", "99", "--png", str(png)]) == 2
    assert capsys.readouterr().err.endswith(": no record 99: the file holds 6; give --record 0 to 5\n")


@pytest.mark.parametrize("text, error", [("[1]\n", "line 1 is not a JSON object"),
                                         ('{"spans": []}\n', "a line has no step")])
def test_timeline_of_a_bad_file_is_one_line(tmp_path, capsys, text, error):
    """A rank's timeline file that is not a run's: one error line naming that file."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    rank = tmp_path / "metrics.jsonl.timeline.rank0.jsonl"
    rank.write_text(text)
    assert main(["timeline", str(metrics), "--png", str(tmp_path / "t.png")]) == 2
    assert capsys.readouterr().err == (f"error: {metrics}: {rank}: {error}; give a file a run with "
                                       "--timing-log-level 2 wrote\n")
