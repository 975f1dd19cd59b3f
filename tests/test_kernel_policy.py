"""The kernel policy (models/kernel_policy.py): built from Megatron's flags and the overrides, each bad
value one line naming it and the fix; the checked tables read from and written to their JSON file.
The same line from both entry scripts: tests/test_megatron_lm.py (it runs Megatron-LM's)."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models import kernel_policy, specs
from megatron_hetero.models.attention import SDPAttention
from megatron_hetero.models.attention_kernels import check_policy
from megatron_hetero.models.kernel_policy import (
    CHECKED_ENV,
    CHECKED_HEAD_DIMS,
    CUDNN_MERGE_CHECKED,
    CUDNN_MERGE_ENV,
    EAGER_ROPE_ENV,
    MLP_KERNEL_ENV,
    MODE_OVERRIDES,
    NORM_KERNEL_ENV,
    OVERRIDE_ENVS,
    AttentionKernelError,
    KernelPolicy,
    KernelPolicyError,
    build,
    mode_now,
)
from megatron_hetero.models.norm import SequenceParallelNorm
from megatron_hetero.models.quack_kernels import QuackChoice


def test_defaults_and_flags():
    assert build(environ={}) == KernelPolicy()
    assert str(KernelPolicy()).startswith("attention auto, RoPE fused, Transformer Engine ")
    assert str(KernelPolicy()).endswith(", norms auto, MLPs auto, experts auto, loss auto, embedding gradient auto, "
                                        "short segments auto, residual add auto, bias GELU auto, attention input "
                                        "auto, small norms auto")
    assert [build(b, environ={}).attention for b in AttnBackend if b.name != "local"] == \
        ["flash", "sdpa", "sdpa", "auto"]
    policy = build("flash", 4, "local", environ={})
    assert (policy.attention, policy.flash_attention_version, policy.te) == ("flash", 4, False)


def test_overrides():
    policy = build(environ={NORM_KERNEL_ENV: "torch", MLP_KERNEL_ENV: "quack", CHECKED_ENV: "128, 80",
                            CUDNN_MERGE_ENV: "1", EAGER_ROPE_ENV: "1"})
    assert policy == KernelPolicy(norm="torch", mlp="quack", fa4_head_dims=(80, 128), cudnn_merge=True,
                                  eager_rope=True)
    assert build(environ={NORM_KERNEL_ENV: "", CUDNN_MERGE_ENV: "0"}) == KernelPolicy()


def test_mode_overrides_table():
    """Each row's variable sets its own field to each of its modes and nothing else, says its modes for
    another value; the policy's mode fields are the table's rows."""
    modes = {name for name, field in KernelPolicy.__dataclass_fields__.items() if field.default == "auto"}
    assert modes - {"attention"} == {row.field for row in MODE_OVERRIDES}
    assert len({row.env for row in MODE_OVERRIDES}) == len(MODE_OVERRIDES)
    for row in MODE_OVERRIDES:
        for mode in row.modes:
            assert build(environ={row.env: mode}) == replace(KernelPolicy(), **{row.field: mode})
            assert mode_now(row.field, {row.env: mode}) == mode
        assert f"{row.label} {row.modes[-1]}" in str(build(environ={row.env: row.modes[-1]}))
        with pytest.raises(KernelPolicyError, match=f"^{row.env}=fast: use one of {', '.join(row.modes)}$"):
            build(environ={row.env: "fast"})


@pytest.mark.parametrize("backend, environ, line", [
    ("cudnn", {}, "--attention-backend cudnn: use one of flash, fused, unfused, local, auto"),
    ("local", {}, "--attention-backend local is Megatron's switch to its --spec local models; for torch SDPA in "
                  "these layers use --attention-backend unfused"),
    ("auto", {NORM_KERNEL_ENV: "apex"}, f"{NORM_KERNEL_ENV}=apex: use one of auto, torch, quack"),
    ("auto", {MLP_KERNEL_ENV: "fused"}, f"{MLP_KERNEL_ENV}=fused: use one of auto, torch, quack"),
    ("auto", {CHECKED_ENV: "64;96"}, f"{CHECKED_ENV}=64;96: give head dims as positive integers, e.g. 64,96,128"),
    ("auto", {CUDNN_MERGE_ENV: "yes"}, f"{CUDNN_MERGE_ENV}=yes: use 1 or 0"),
    ("auto", {EAGER_ROPE_ENV: "true"}, f"{EAGER_ROPE_ENV}=true: use 1 or 0"),
])
def test_bad_value_is_one_line(backend, environ, line):
    with pytest.raises(KernelPolicyError) as error:
        build(backend, environ=environ)
    assert str(error.value) == line


def test_flash_is_checked_per_module_where_our_layers_run_it():
    asked = []

    def head_dims():
        asked.append(True)
        return {"vision": 16}

    check_policy(build("auto", environ={}), head_dims, torch.float32)
    check_policy(KernelPolicy("flash", transformer_impl="local"), lambda: {}, torch.float32)
    assert not asked  # head dims only where flash-attn-4 must serve them
    with pytest.raises(KernelPolicyError, match="^module vision: --attention-backend flash: head dim 16: no GPU; "
                                                "or use --attention-backend auto$"):
        check_policy(KernelPolicy("flash", transformer_impl="local"), head_dims, torch.float32)


def test_layers_take_the_policy_of_their_config(monkeypatch):
    """A layer's policy is its TransformerConfig's flags with the environment's overrides: a config
    saying --transformer-impl local gets no Transformer Engine layers where TE imports, one saying
    --attention-backend unfused SDPA and one saying flash flash-attn-4 or its one line (no GPU here);
    an override set in the environment holds for every config's layers."""
    monkeypatch.setattr(kernel_policy, "HAVE_TE", True)
    for env in OVERRIDE_ENVS:
        monkeypatch.delenv(env, raising=False)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1)
    local = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, transformer_impl="local",
                              attention_backend=AttnBackend.unfused)
    assert kernel_policy.of(config) == KernelPolicy() and specs.uses_te(config)
    assert kernel_policy.of(local) == KernelPolicy("sdpa", transformer_impl="local") and not specs.uses_te(local)
    flash = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, attention_backend=AttnBackend.flash)
    groups = SimpleNamespace(cp=None)
    assert SDPAttention(local, 1, AttnMaskType.causal, "self", pg_collection=groups).kernel.kernel == "sdpa"
    with pytest.raises(AttentionKernelError, match="^--attention-backend flash: head dim 16: no GPU"):
        SDPAttention(flash, 1, AttnMaskType.causal, "self", pg_collection=groups)
    monkeypatch.setenv(NORM_KERNEL_ENV, "torch")
    assert kernel_policy.of(config).norm == kernel_policy.of(local).norm == "torch"
    assert SequenceParallelNorm(local, 16).kernel == QuackChoice("torch", f"{NORM_KERNEL_ENV}=torch")
    monkeypatch.setenv(NORM_KERNEL_ENV, "apex")
    with pytest.raises(KernelPolicyError, match=f"^{NORM_KERNEL_ENV}=apex: use one of auto, torch, quack$"):
        kernel_policy.of(config)


def test_every_modules_config_carries_the_validated_flags():
    """The flags the arguments are checked with reach each module's TransformerConfig (an LLM's and
    an encoder's), so its layers get the policy printed at start."""
    from megatron_hetero.models.vlm import transformer_config
    from megatron_hetero.training.args import parse_script_args
    from megatron_hetero.training.providers import megatron_config_fields

    args = parse_script_args(["--attention-backend", "unfused"], validate=False)
    fields = megatron_config_fields(args)
    validated = build(args.attention_backend, args.flash_attention_version, args.transformer_impl)
    assert validated == build("unfused", None, "local")  # the example's --transformer-impl local default
    for dims in ((64, 2, 4), (32, 1, 2)):
        assert kernel_policy.of(transformer_config(*dims, 1, torch.float32, **fields)) == validated


def test_tables_come_from_the_json_file_the_checks_write(tmp_path):
    """The shipped table (the tests' user table is empty: conftest.py); record_check writes a passing
    result into a table, creating it."""
    checks = json.loads(kernel_policy.CHECKS_FILE.read_text())
    assert CHECKED_HEAD_DIMS == {gpu: tuple(dims) for gpu, dims in checks["fa4_checked_head_dims"].items()}
    assert CUDNN_MERGE_CHECKED == tuple(checks["cudnn_merge_checked"])
    path = tmp_path / "checks.json"
    path.write_text(kernel_policy.CHECKS_FILE.read_text())
    kernel_policy.record_check("NVIDIA B200", fa4_head_dims=(128, 64), path=path)
    kernel_policy.record_check("NVIDIA B200", cudnn_merge=True, path=path)
    kernel_policy.record_check("NVIDIA B200", cudnn_merge=True, path=path)
    written = json.loads(path.read_text())
    assert written["fa4_checked_head_dims"]["NVIDIA B200"] == [64, 128]
    assert written["cudnn_merge_checked"] == [*CUDNN_MERGE_CHECKED, "NVIDIA B200"]


def test_the_users_table_is_merged_over_the_shipped_one(tmp_path, monkeypatch):
    """--record writes the user's table (MEGATRON_HETERO_KERNEL_CHECKS, else under ~/.cache), created
    on first use; its entry for a GPU replaces the shipped one, other GPUs keep theirs; a corrupt
    table is one line naming the file."""
    user = tmp_path / "cache" / "kernel_checks.json"
    monkeypatch.setenv(kernel_policy.USER_CHECKS_ENV, str(user))
    assert kernel_policy.user_checks_file() == user
    assert kernel_policy.user_checks_file({"HOME": "/h"}).parts[-3:] == (".cache", "megatron_hetero",
                                                                         "kernel_checks.json")
    h100 = "NVIDIA H100 80GB HBM3"
    assert kernel_policy.record_check("NVIDIA B200", fa4_head_dims=(96,), cudnn_merge=True) == user
    kernel_policy.record_check(h100, fa4_head_dims=(64, 128, 80))
    dims, lists = kernel_policy.load_checks(kernel_policy.CHECKS_FILE, user)
    assert dims == {**CHECKED_HEAD_DIMS, "NVIDIA B200": (96,), h100: (64, 80, 128)}
    assert lists["cudnn_merge_checked"] == (*CUDNN_MERGE_CHECKED, "NVIDIA B200")
    user.write_text('{"fa4_checked_head_dims": [')
    with pytest.raises(KernelPolicyError, match="kernel_checks.json: not a kernel checks table"):
        kernel_policy.load_checks(kernel_policy.CHECKS_FILE, user)


def test_a_corrupt_user_table_is_one_line_when_the_arguments_are_checked(tmp_path, monkeypatch):
    """A user's table that is not one does not stop the import: the shipped table serves, and the
    arguments' check (build) stops with the line naming the file."""
    bad = tmp_path / "checks.json"
    bad.write_text("{bad")
    tables, problem = kernel_policy._tables({kernel_policy.USER_CHECKS_ENV: str(bad)})
    assert tables == kernel_policy.load_checks(kernel_policy.CHECKS_FILE)
    assert problem.startswith(f"{bad}: not a kernel checks table") and "\n" not in problem
    monkeypatch.setattr(kernel_policy, "USER_CHECKS_PROBLEM", problem)
    with pytest.raises(KernelPolicyError, match="not a kernel checks table"):
        kernel_policy.build()



def test_cross_entropy_fusion_reaches_the_configs_with_bf16_only():
    """Megatron's --cross-entropy-loss-fusion reaches every module's config (the LLM's loss reads it);
    its native kernel's gradient is bf16 whatever the logits' dtype, so without --bf16 it is one line."""
    from megatron_hetero.training.args import parse_script_args
    from megatron_hetero.training.layout_args import ArgsError, check_kernels
    from megatron_hetero.training.providers import megatron_config_fields

    args = parse_script_args(["--cross-entropy-loss-fusion"], validate=False)
    fields = megatron_config_fields(args)
    assert fields["cross_entropy_loss_fusion"] and fields["cross_entropy_fusion_impl"] == "native"
    with pytest.raises(ArgsError, match="^--cross-entropy-loss-fusion rounds the logits' gradient to bf16 .*"
                                        "trains in float32: add --bf16 or drop --cross-entropy-loss-fusion$"):
        check_kernels(args, dict)
    args.bf16 = True
    check_kernels(args, dict)
    assert not megatron_config_fields(parse_script_args([], validate=False))["cross_entropy_loss_fusion"]


def test_bias_dropout_add_fusion_stays_on_gpus_only():
    """Megatron's --bias-dropout-fusion (default on) is megatron-core's torch.compile'd kernel, not apex's
    or TE's: kept where a GPU runs it and carried into every module's config; off on CPUs, with the
    fusions that need apex or TE."""
    from megatron_hetero.patches import startup
    from megatron_hetero.training.args import parse_script_args
    from megatron_hetero.training.providers import megatron_config_fields

    for gpus in (True, False):
        args = parse_script_args([], validate=False)
        for flag in (*startup.FUSION_FLAGS, *startup.COMPILED_FUSION_FLAGS):
            setattr(args, flag, True)
        startup.disable_unavailable_fusions(args, gpus=gpus)
        assert megatron_config_fields(args)["bias_dropout_fusion"] is gpus
        assert not any(getattr(args, flag) for flag in startup.FUSION_FLAGS) and args.no_persist_layer_norm
