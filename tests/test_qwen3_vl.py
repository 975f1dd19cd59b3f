"""Qwen3-VL and Qwen3-VL-MoE (megatron_hetero/families/qwen3_vl) from tiny random transformers models
built offline (tests/qwen3_vl_models.py: two DeepStack blocks into LLM layers 0 and 1): our forward
equals transformers' (logits within 1e-4 fp32, `hf compare`) on one process and under vision DP2,
LLM TP2 with SP, LLM PP2 (the second DeepStack block's rows cross the stage boundary), LLM CP2,
non-colocated and, for the MoE model, LLM EP2 (its experts on SequentialMLP and on grouped GEMMs, these
under expert TP2 too); import -> export is bit-identical (the MoE experts in transformers' fused
layout and in the Hub's transposed one) and the export loads in transformers;
3 training steps under LLM PP2 equal one process's (1e-4). The rest of the training matrix, at micro
batch 2 and 1, runs under `make test-families` (pytest -m families). The data are Qwen2.5-VL's (its
tests check them against transformers' processor; Qwen3-VL uses the same processor and get_rope_index
for images)."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.distributed import collect_distributed
from tests.qwen3_vl_models import model_class, qwen3_vl_dir
from tests.test_checkpoint import at
from tests.test_qwen2_5_vl import (
    MICRO_BATCH_1,
    SEQ,
    TOL,
    _cli,
    _report,
    _tensors,
    _train_flags,
    assert_same_steps,
    train,
)
from tests.vlm_fixtures import conversations

_C = "placement: colocated\nmodules:\n"
LAYOUTS = {
    "single": _C + "  vision: {role: encoder}\n  llm: {role: llm}\n",
    "vdp2_ltp2": _C + "  vision: {role: encoder, dp: 2}\n  llm: {role: llm, tp: 2}\n",
    "vdp2_ltp2sp": _C + "  vision: {role: encoder, dp: 2}\n  llm: {role: llm, tp: 2, sp: true}\n",
    "lpp2": _C + "  vision: {role: encoder, dp: 2}\n  llm: {role: llm, pp: 2}\n",
    "lcp2": _C + "  vision: {role: encoder, tp: 2}\n  llm: {role: llm, cp: 2}\n",
    # each image's merge blocks split over vision CP2, DeepStack rows with them
    "vcp2_lcp2": _C + "  vision: {role: encoder, cp: 2}\n  llm: {role: llm, cp: 2}\n",
    "noncolocated_lpp2": "placement: non_colocated\nmodules:\n  vision: {role: encoder, ranks: 0-0}\n"
                         "  llm: {role: llm, pp: 2, ranks: 1-2}\n",
}
MOE_LAYOUTS = {"lep2": _C + "  vision: {role: encoder, dp: 2}\n  llm: {role: llm, dp: 2, ep: 2}\n",
               "lpp2": LAYOUTS["lpp2"]}


def _setup(tmp: Path, moe: bool) -> tuple[Path, Path]:
    qwen3_vl_dir(tmp / "hf", moe=moe)
    data = conversations(tmp / "data")
    result = _cli("import", "--model", tmp / "hf", "--save", tmp / "ckpt")
    assert result.returncode == 0, result.stderr[-3000:]
    for name, text in {**LAYOUTS, **(MOE_LAYOUTS if moe else {})}.items():
        (tmp / f"{name}.yaml").write_text(text)
    return tmp, data


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("qwen3_vl"), moe=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("qwen3_vl_moe"), moe=True)


def _compare_args(tmp: Path, data: Path, *extra) -> list[str]:
    return ["compare", "--model", str(tmp / "hf"), "--load", str(tmp / "ckpt"), "--data-path", str(data),
            "--seq-length", str(SEQ), *map(str, extra)]


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_compare_one_process(request, model):
    """Our forward (one process) against transformers' on 5 samples (images of different sizes, two
    in one sample, one over max pixels, a text-only sample): DeepStack, interleaved M-RoPE, QK-norm
    and (MoE) the routed experts as transformers computes them."""
    tmp, data = request.getfixturevalue(model)
    result = _cli(*_compare_args(tmp, data))
    assert result.returncode == 0, result.stderr[-3000:]
    per_sample, worst = _report(result.stdout)
    print(result.stdout)
    assert len(per_sample) == 5 and max(per_sample) == worst <= TOL


def _compare_worker(rank, world_size, tmp, data, names):
    from megatron_hetero.hf.__main__ import main

    results = {}
    for name in names:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(_compare_args(Path(tmp), Path(data), "--hetero-layout", Path(tmp) / f"{name}.yaml"))
        results[name] = (code, out.getvalue())
    return results


def _compare_under(fixture, names, world, tmp_path):
    tmp, data = fixture
    rank0 = collect_distributed(_compare_worker, world, tmp_path, str(tmp), str(data), names)[0]
    for name, (code, text) in rank0.items():
        print(name, text.strip().splitlines()[-1])
        per_sample, worst = _report(text)
        assert code == 0 and len(per_sample) == 5 and worst <= TOL, (name, text)


def test_compare_under_layouts(dense, tmp_path):
    """`hf compare --hetero-layout` on 2 processes: vision DP2 -> LLM TP2 with SP, LLM PP2 (DeepStack
    rows into layer 1 cross the stage boundary), vision TP2 -> LLM CP2, vision CP2 -> LLM CP2:
    transformers' logits within 1e-4."""
    _compare_under(dense, ["vdp2_ltp2sp", "lpp2", "lcp2", "vcp2_lcp2"], 2, tmp_path)


def test_compare_moe_under_expert_parallel(moe, tmp_path):
    """The MoE model under LLM EP2 (experts split over 2 ranks) and LLM PP2: transformers' logits within 1e-4."""
    _compare_under(moe, ["lep2", "lpp2"], 2, tmp_path)


@pytest.mark.families
def test_compare_non_colocated(dense, tmp_path):
    """Non-colocated, vision on rank 0 -> LLM PP2 on ranks 1-2: DeepStack rows go from the vision rank to
    both LLM stages' ranks (the second block through stage 0)."""
    _compare_under(dense, ["noncolocated_lpp2"], 3, tmp_path)


# ---- import / export --------------------------------------------------------------------------
def _hub_experts(directory: Path) -> None:
    """Rewrite the directory's fused expert tensors in the Hub's published layout (each expert's
    weight transposed; transformers transposes them on load)."""
    tensors = {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in _tensors(directory).items()}
    for f in directory.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("variant", ["dense", "moe_transformers", "moe_hub"])
def test_import_export_round_trip(tmp_path, variant):
    """import -> export gives the imported files back bit for bit (every tensor, in the imported
    layout); transformers loads the export and computes what the original does."""
    moe = variant.startswith("moe")
    src = qwen3_vl_dir(tmp_path / "hf", moe=moe)
    if variant == "moe_hub":
        _hub_experts(src)
    original = _tensors(src)
    for command in (("import", "--model", src, "--save", tmp_path / "ckpt"),
                    ("export", "--load", tmp_path / "ckpt", "--out", tmp_path / "out")):
        result = _cli(*command)
        assert result.returncode == 0, result.stderr[-3000:]
    scheme = json.loads((tmp_path / "ckpt" / "model.json").read_text())["hf"]["scheme"]
    assert scheme == ("hub" if variant == "moe_hub" else "transformers")
    exported = _tensors(tmp_path / "out")
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    for name in ("tokenizer.json", "chat_template.jinja", "preprocessor_config.json", "config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes(), name
    a, b = (model_class(moe).from_pretrained(d, dtype=torch.float32) for d in (src, tmp_path / "out"))
    ids = torch.arange(5, 25)[None]
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


# ---- training ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(dense):
    return train(*dense, "reference", "single", 1)


def test_training_equals_one_process(dense, reference):
    """3 steps under LLM PP2 (DeepStack across the stage boundary, vision DP2): loss and gradient
    norm per step within 1e-4 of one process's."""
    assert_same_steps(reference, train(*dense, "lpp2", "lpp2", 2))


@pytest.mark.families
@pytest.mark.parametrize("layout", ["vdp2_ltp2sp", "lcp2", "noncolocated_lpp2", "vcp2_lcp2"])
def test_training_equals_one_process_matrix(dense, reference, layout):
    """Vision DP2 -> LLM TP2 with SP, vision TP2 -> LLM CP2, non-colocated vision -> LLM PP2, vision
    CP2 -> LLM CP2."""
    assert_same_steps(reference, train(*dense, layout, layout, 3 if layout.startswith("non") else 2))


@pytest.mark.families
@pytest.mark.parametrize("schedule", ["three-phase", "bubbles"])
def test_ordered_colocated_schedules(dense, reference, schedule):
    """LLM PP2 with the encoder's work ordered around the pipeline (no recompute): DeepStack rows
    cross the stage boundary the same way; 3 steps equal one process's."""
    assert_same_steps(reference, train(*dense, schedule, "lpp2", 2, ["--hetero-colocated-schedule", schedule]))


@pytest.mark.families
def test_checkpoint_resumes_under_another_layout(dense):
    """Saved at step 2 under LLM PP2 (vision DP2), resumed for step 3 under vision TP2 (the DeepStack
    mergers' projectors split) -> LLM CP2: step 3 equals the uninterrupted PP2 run's within 1e-5."""
    tmp, data = dense
    saved = tmp / "saved"
    straight = train(tmp, data, "straight", "lpp2", 2, ["--save", str(saved), "--save-interval", "2"])
    resumed = train(tmp, data, "resumed", "lcp2", 2, ["--load", str(at(saved, 2, "lcp2"))])
    assert_same_steps(straight, resumed, rel=1e-5, first=3)


@pytest.fixture(scope="module")
def reference_micro_batch_1(dense):
    return train(*dense, "reference_mbs1", "single", 1, MICRO_BATCH_1)


@pytest.mark.families
@pytest.mark.parametrize("layout", ["vdp2_ltp2", "vdp2_ltp2sp", "lpp2", "lcp2", "noncolocated_lpp2"])
def test_micro_batch_1_equals_one_process(dense, reference_micro_batch_1, layout):
    """Micro batch 1 (DeepStack's rows written like the main ones) under vision DP2 -> LLM TP2 without
    and with SP, LLM PP2, LLM CP2 and non-colocated: 3 steps equal one process's."""
    world = 3 if layout.startswith("non") else 2
    assert_same_steps(reference_micro_batch_1, train(*dense, f"{layout}_mbs1", layout, world, MICRO_BATCH_1))


@pytest.mark.families
@pytest.mark.parametrize("micro_batch", [2, 1])
def test_moe_training_under_expert_parallel(moe, micro_batch):
    """The MoE model: 3 steps under LLM EP2 equal one process's, at micro batch 2 and 1."""
    flags = ["--micro-batch-size", str(micro_batch)]
    assert_same_steps(train(*moe, f"reference_mbs{micro_batch}", "single", 1, flags),
                      train(*moe, f"lep2_mbs{micro_batch}", "lep2", 2, flags))


# ---- DeepStack edges in layout files, refusals ----------------------------------------------------
def test_layout_check_deepstack_edges(dense):
    """`layout check --model-sizes` prints the LLM stage that adds each DeepStack edge (under LLM PP2
    the second on stage 1) and refuses a layout whose DeepStack edges are not the model's."""
    from tests.distributed import run_python

    tmp, _ = dense
    check = ["-m", "megatron_hetero.layout", "check", "--world-size", "2", "--model-sizes", tmp / "ckpt" / "model.json"]
    result = run_python([*check[:3], tmp / "lpp2.yaml", *check[3:]])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-2:] == ["vision[0] -> llm[0]: added on llm stage 0",
                                                       "vision[2] -> llm[1]: added on llm stage 1"]
    (tmp / "wrong_edges.yaml").write_text(LAYOUTS["lpp2"] + "edges: [vision -> llm, 'vision[1] -> llm[0]']\n")
    result = run_python([*check[:3], tmp / "wrong_edges.yaml", *check[3:]])
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: edges: the layout's DeepStack edges differ from the model's (vision[0] -> llm[0], "
        "vision[2] -> llm[1]); list exactly those or none (then the model's are implied)")


_FOUR_RANKS = _C + "  vision: {role: encoder, dp: 4}\n  llm: {role: llm, dp: 2, pp: 2}\n"


@pytest.mark.parametrize("layout_text, flags, expected", [
    (_FOUR_RANKS + "edges: [vision -> llm, 'vision[0] -> llm[0]']\n", (),
     "edges: the layout's DeepStack edges differ from the model's (vision[0] -> llm[0], vision[2] -> llm[1])"),
    (_FOUR_RANKS, ("--recompute-granularity", "full", "--recompute-method", "uniform"),
     "--recompute-granularity full: the qwen3_vl DeepStack rows are added between LLM layers"),
])
def test_training_refusals(dense, tmp_path, layout_text, flags, expected):
    """What a Qwen3-VL model cannot train with: one `error:` line naming the layout field or flag."""
    from tests.test_pretrain_errors import _run

    tmp, data = dense
    result = _run(["--hetero-layout", "layout.yaml", *_train_flags(tmp, data), *flags], tmp_path, layout_text)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert expected in result.stderr.strip().splitlines()[-1], result.stderr[-500:]


def _grouped_compare_worker(rank, world_size, tmp, data, names):
    """_compare_worker with the experts on grouped GEMMs (forced on CPUs), counting their grouped calls."""
    import os

    from megatron_hetero.models import experts
    from megatron_hetero.models.kernel_policy import EXPERTS_KERNEL_ENV

    os.environ[EXPERTS_KERNEL_ENV] = "grouped"
    calls, apply = [], experts._GroupedLinear.apply
    experts._GroupedLinear.apply = lambda *args: (calls.append(1), apply(*args))[1]
    return _compare_worker(rank, world_size, tmp, data, names), len(calls)


def test_grouped_experts_under_expert_parallel(moe, tmp_path):
    """The MoE model's experts on grouped GEMMs (models/experts.py) under LLM EP2, LLM TP2 with SP
    (expert TP2: each expert's ffn split) and LLM PP2: transformers' logits within 1e-4, and the
    grouped GEMMs ran on every rank."""
    tmp, data = moe
    names = ["lep2", "vdp2_ltp2sp", "lpp2"]
    ranks = collect_distributed(_grouped_compare_worker, 2, tmp_path, str(tmp), str(data), names)
    for name, (code, text) in ranks[0][0].items():
        per_sample, worst = _report(text)
        assert code == 0 and len(per_sample) == 5 and worst <= TOL, (name, text)
    assert len(ranks[0][0]) == len(names) and all(calls > 0 for _, calls in ranks)


def _train_grouped(rank, world_size, argv):
    """test_checkpoint's _train with the experts on grouped GEMMs (forced on CPUs)."""
    import os

    from megatron_hetero.models.kernel_policy import EXPERTS_KERNEL_ENV
    from tests.test_checkpoint import _train

    os.environ[EXPERTS_KERNEL_ENV] = "grouped"
    _train(rank, world_size, argv)


@pytest.mark.families
def test_grouped_experts_train_under_expert_parallel(moe, monkeypatch):
    """3 steps with the experts on grouped GEMMs under LLM EP2 equal one process's on SequentialMLP."""
    import tests.test_qwen2_5_vl

    reference = train(*moe, "reference_sequential", "single", 1)
    monkeypatch.setattr(tests.test_qwen2_5_vl, "_train", _train_grouped)
    assert_same_steps(reference, train(*moe, "lep2_grouped", "lep2", 2))
