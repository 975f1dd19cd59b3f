"""megatron-hetero's patches of megatron-core / megatron.training: what apply() replaces, that it
replaces it once, and that a patch refuses upstream code it was not written for (one line)."""

import contextlib
import copy
import importlib.util
import os
import re
import sys
from pathlib import Path

import megatron.core
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_hetero import launch
from megatron_hetero.patches import PatchError, _patch, apply, check_version
from tests.compiling import assert_compiled_equals_eager
from tests.distributed import run_distributed

# Everything apply() changes, in the order it does (the CPU ones only where no GPU is present): the
# upstream functions and classes it replaces, the values it sets, a module it provides, the context
# it enters. A new patch must be added here, and to the patch table of docs/developers/internals.md.
TARGETS = [
    "megatron.core.datasets.utils.compile_helpers",
    "megatron.training.training.initialize_megatron",
    "megatron.core.models.vision.clip_vit_model.CLIPViTModel.__init__",
    "megatron.training.arguments.add_megatron_arguments",
    "megatron.training.arguments.validate_args",
    "megatron.training.initialize._initialize_distributed",
    "megatron.training.training.get_model",
    "megatron.core.models.multimodal.llava_model.LLaVAModel",
    "megatron.training.training.get_megatron_optimizer",
    "megatron.training.training.build_pretraining_data_loader",
    "megatron.training.training.get_forward_backward_func",
    "megatron.training.training.save_checkpoint",
    "megatron.training.training.load_checkpoint",
    "megatron.training.checkpointing.generate_state_dict",
    "megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_state_dict",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states",
    "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.finish_grad_sync",
    "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.reset",
    "megatron.core.transformer.moe.moe_logging.MoEMetricsTracker._aggregate",
    "megatron.training.training.training_log",
    "megatron.training.training.train_step",
    "megatron.training.training.train",
    "megatron.training.training.setup_model_and_optimizer",
    "megatron.training.training.save_checkpoint_and_time",
    "megatron.core.models.multimodal.llava_spec.decoder_model_with_local_default_spec",
    "megatron.core.models.vision.vit_layer_specs.get_vit_layer_with_local_spec",
    "megatron.core.transformer.attention.apply_rotary_pos_emb",
    "megatron.core.models.common.language_module.language_module.LanguageModule.compute_language_model_loss",
    "megatron.core.tensor_parallel.layers.F",
    "megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that",
    "megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups",
    "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
    "megatron.core.transformer.moe.token_dispatcher.sort_chunks_by_idxs",
    "megatron.core.tensor_parallel.layers._initialize_affine_weight_cpu",
]
CPU_TARGETS = [
    *(f"torch.cuda.{name}" for name in ("current_device", "current_stream", "default_stream", "Stream", "Event",
                                        "stream", "synchronize", "get_rng_state", "set_rng_state", "manual_seed",
                                        "manual_seed_all")),
    "megatron.core.tensor_parallel.random._get_cuda_rng_state",
    "megatron.core.tensor_parallel.random._set_cuda_rng_state",
    "megatron.core.models.common.embeddings.rotary_pos_embedding.get_pos_emb_on_this_cp_rank",
    "megatron.training.arguments.get_device_arch_version",
    "megatron.training.initialize._initialize_distributed",  # again: counting one device
    "megatron.training.initialize._set_random_seed",
    "megatron.training.initialize._warmup_jit_function",
    "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
    "megatron.core.tensor_parallel.mappings._gather_along_first_dim",
    "megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim",
    "torch.distributed.new_group",
    "torch.distributed.new_subgroups_by_enumeration",
]
# Without apex (the module megatron-core imports for gradient-accumulation fusion, and its flags; the
# gradient norm's and the clip's fallbacks, which Transformer Engine's kernels would also replace).
NO_APEX_TARGETS = [
    "sys.modules['fused_weight_gradient_mlp_cuda']",
    "megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda",
    "megatron.core.tensor_parallel.layers._grad_accum_fusion_available",
    "megatron.core.optimizer.clip_grads.l2_norm_impl",
    "megatron.core.optimizer.clip_grads.multi_tensor_scale_impl",
    "megatron.core.optimizer.optimizer.multi_tensor_scale_impl",
]


def _expected() -> list[str]:
    """What apply() changes here, sorted (a target changed by two patches appears twice)."""
    from megatron_hetero.patches import cpu, fa4_backward

    cpu_targets = [*CPU_TARGETS, cpu.MODE] if not torch.cuda.is_available() else []
    fa4_targets = [fa4_backward.KERNEL] if fa4_backward.applies() else []  # where flash-attn-4 is installed
    return sorted(TARGETS + cpu_targets + fa4_targets
                  + (NO_APEX_TARGETS if importlib.util.find_spec("apex") is None else []))


def _wraps(function, original) -> bool:
    """`function` reaches `original` through its chain of __wrapped__."""
    while function is not None:
        if function is original:
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def _value(path: str):
    if path.startswith("sys.modules"):
        return sys.modules.get(path.split("'")[1])
    try:
        return _patch.upstream(path)[2]
    except PatchError:
        return None  # not there before the patch created it


def _check_apply(rank, world_size):
    targets = [t for t in _expected() if not t.startswith("torch functions")]
    replaced = [t for t in targets if t not in NO_APEX_TARGETS]
    originals = {path: _value(path) for path in targets}
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    apply()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # where the plugin is applied, launcher or not
    assert sorted(_patch.applied()) == _expected(), "apply() changes exactly the targets listed here"
    patched = {path: _value(path) for path in targets}
    for path in replaced:
        assert patched[path] is not originals[path], f"{path} not replaced"
        assert _wraps(patched[path].__wrapped__, originals[path]), f"{path} does not wrap the original"
    apply()  # a second time: nothing changes
    assert sorted(_patch.applied()) == _expected()
    assert {path: _value(path) for path in targets} == patched
    _patch.undo()  # every change undone: upstream's objects again
    assert _patch.applied() == [] and {path: _value(path) for path in targets} == originals
    if not torch.cuda.is_available():  # device='cuda' is no longer sent to the CPU
        try:
            torch.empty(1, device="cuda")
            raise AssertionError("the CPU mode is still entered after undo()")
        except (RuntimeError, AssertionError) as error:
            assert "still entered" not in str(error)
    apply()  # and again
    assert sorted(_patch.applied()) == _expected()
    assert all(_wraps(_value(path).__wrapped__, originals[path]) for path in replaced)


def test_apply_replaces_each_target_once():
    """apply() changes exactly the targets listed here (docs/developers/internals.md's table lists them too); each
    replaced one is a new function whose __wrapped__ chain reaches upstream's; a second apply()
    changes nothing; undo() restores every upstream object and leaves the CPU mode, and apply()
    works again. In a spawned process: the patches stay for the life of the process they are
    applied in."""
    run_distributed(_check_apply, 1)


def test_patch_table_lists_every_target():
    """The patch table (docs/developers/internals.md) names every target apply() changes (without
    megatron's prefix)."""
    internals = (Path(__file__).parent.parent / "docs" / "developers" / "internals.md").read_text()
    table = internals.split("| patch | upstream")[1].split("\n\n")[0]
    from megatron_hetero.patches import cpu, fa4_backward

    missing = [t for t in TARGETS + CPU_TARGETS + NO_APEX_TARGETS + [fa4_backward.KERNEL]
               if t.removeprefix("megatron.") not in table and t != cpu.MODE]
    assert not missing, f"the patch table in docs/developers/internals.md lacks {missing}"


def test_cuda_connections_set_where_unset(monkeypatch, capsys):
    """apply() sets CUDA_DEVICE_MAX_CONNECTIONS=1 where the environment lacks it (Megatron's argument
    check asks for it with TP or CP on GPUs), with one line on GPUs (rank 0), none on CPUs; a value
    the user set stays. (That apply() does it: test_apply_replaces_each_target_once.)"""
    from megatron_hetero.patches import startup

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setenv("RANK", "0")
    notice = startup.set_cuda_connections(gpus=True)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert capsys.readouterr().out.splitlines() == [notice] and "CUDA_DEVICE_MAX_CONNECTIONS=1" in notice
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert startup.set_cuda_connections(gpus=True) is None and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    monkeypatch.setenv("RANK", "1")
    assert startup.set_cuda_connections(gpus=True) and capsys.readouterr().out == ""  # rank 0 says it
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert startup.set_cuda_connections(gpus=False) is None and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


@pytest.mark.parametrize("path", [
    "megatron.training.training.no_such_function",
    "megatron.training.training.NoSuchClass.method",
    "megatron.core.no_such_module.function",
])
def test_missing_target(path):
    """A target that does not exist upstream: PatchError, one line naming it; nothing replaced."""
    with pytest.raises(PatchError) as error:
        _patch.replace(path, lambda original: original)
    assert path in str(error.value) and "\n" not in str(error.value)


def test_signature_lacks_parameter():
    """A patch relying on a parameter upstream's signature lacks: PatchError, one line naming the
    function and the parameter; the function stays upstream's."""
    from megatron.training import training

    before = training.get_model
    with pytest.raises(PatchError) as error:
        _patch.replace("megatron.training.training.get_model", lambda original: original,
                       params=("model_provider_func", "no_such_parameter"))
    message = str(error.value)
    assert "megatron.training.training.get_model" in message and "no_such_parameter" in message
    assert "\n" not in message and training.get_model is before


def test_version_check(monkeypatch, tmp_path, capsys):
    """check_version accepts the 0.19 minor and refuses another one: apply() then patches nothing
    and the launcher stops before the script with one `error:` line, exit code 2."""
    monkeypatch.setattr(megatron.core, "__version__", "0.19.7")
    check_version()
    from megatron.training import training

    before = training.get_model
    for version in ("0.20.0", "0.190.1", "1.19.0"):
        monkeypatch.setattr(megatron.core, "__version__", version)
        with pytest.raises(PatchError, match=rf"found {re.escape(version)}: install megatron-core>=0\.19,<0\.20"):
            apply()
    assert training.get_model is before
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('the script ran')\n")
    capsys.readouterr()
    assert launch.main([str(script), "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: megatron-hetero's patches target megatron-core 0.19.x") and err.count("\n") == 1


def _reduce_with_missing_gradients(rank, world_size):
    """megatron-core DDP with --overlap-grad-reduce, microbatches under no_sync but the last: steps
    whose last microbatch gives only some parameters a gradient (an encoder with no rows in it),
    the first step included. Every bucket is reduced once per step: the gradients equal the
    microbatches' autograd gradients averaged over the ranks."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    apply()
    world = dist.group.WORLD
    own = [dist.new_group([r]) for r in range(world_size)][rank]
    pgs = ProcessGroupCollection(dp=world, dp_cp=world, intra_dp_cp=world, expt_dp=world,
                                 intra_expt_dp=world, tp=own, pp=own, ep=own, cp=own)
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    for distributed_optimizer in (False, True):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        reference = [p.detach().clone().requires_grad_() for p in module.parameters()]
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=distributed_optimizer, bucket_size=20),
            module, pg_collection=pgs)
        assert len(ddp.bucket_groups) > 1
        # Per step, which layers the last microbatch reaches (0: the first only; 1: both).
        for step, last_reaches in enumerate([0, 1, 0, 0]):
            ddp.zero_grad_buffer()
            for p in reference:
                p.grad = None
            for i in range(3):
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + 10 * i + rank))
                last = i == 2
                layers = 2 if not last or last_reaches else 1
                with ddp.no_sync() if not last else contextlib.nullcontext():
                    module[:layers](x).square().sum().backward()
                y = x
                for k in range(layers):
                    y = torch.nn.functional.linear(y, reference[2 * k], reference[2 * k + 1])
                y.square().sum().backward()
            ddp.finish_grad_sync()
            for p in reference:
                dist.all_reduce(p.grad)
                p.grad /= world_size
            if distributed_optimizer:  # each rank reduced its own shard: gather them
                for bucket in [b for group in ddp.bucket_groups for b in group.buckets]:
                    shard = bucket.grad_data.chunk(world_size)[rank].clone()
                    dist.all_gather_into_tensor(bucket.grad_data, shard)
            for p, want in zip(module.parameters(), reference):
                torch.testing.assert_close(p.main_grad, want.grad, msg=f"step {step}, {distributed_optimizer=}")


def test_overlapped_reduction_of_missing_gradients():
    run_distributed(_reduce_with_missing_gradients, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_is_upstreams_rope(dtype):
    """models/rope.py's rotation (compiled on GPUs by patches/rope.py) is upstream's rotary embedding bit for bit when
    run eagerly, whole head rotated, frequencies shaped as megatron-core's RotaryEmbedding makes them
    ([s, 1, 1, d]); on CPUs the patched function gives upstream's."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hetero.models import rope

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(24, 2, 4, 16, generator=gen).to(dtype)
    freqs = torch.randn(24, 1, 1, 16, generator=gen) * 30
    for mscale in (1.0, 0.7):
        assert torch.equal(rope.rotate(t, *rope.cos_sin(freqs, mscale, t.dtype)),
                           rope_utils._apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale))
    apply()
    config, group = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4), SimpleNamespace()
    assert torch.equal(attention.apply_rotary_pos_emb(t, freqs, config, cp_group=group),
                       rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=group))


def test_compiled_rotation_equals_eager():
    """The rotation as patches/rope.py runs it on GPUs (compiled), here on the CPU (the tests' processes turn
    compile off; on here) against eager, in float64: output and the gradients of the input and the tables."""
    from megatron_hetero.models.rope import rotate
    from megatron_hetero.patches.rope import _compiled_rotate

    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(7, 2, 3, 16, generator=g, dtype=torch.float64)]
    leaves += [torch.randn(7, 1, 1, 16, generator=g, dtype=torch.float64) for _ in range(2)]
    dout = torch.randn(7, 2, 3, 16, generator=g, dtype=torch.float64)
    assert_compiled_equals_eager(lambda compiled, *inputs: (_compiled_rotate() if compiled else rotate)(*inputs),
                                 leaves, dout, tol=1e-12)


def test_rope_is_fused_where_the_layers_policy_and_shape_allow(monkeypatch):
    """The fused rotation takes upstream's bshd path only: the whole head rotated, not interleaved, no
    packed thd layout or TE fusion asked; and not where the layer's kernel policy says eager
    (MEGATRON_HETERO_EAGER_ROPE=1), per call."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hetero.models.kernel_policy import EAGER_ROPE_ENV
    from megatron_hetero.patches import rope

    monkeypatch.delenv(EAGER_ROPE_ENV, raising=False)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    assert rope.fuses(config, 16, 16)
    assert not rope.fuses(config, 16, 8) and not rope.fuses(config, 16, 16, cu_seqlens=torch.tensor([0, 24]))
    assert not rope.fuses(config, 16, 16, mla_rotary_interleaved=True)
    for field in ("rotary_interleaved", "apply_rope_fusion"):
        changed = copy.copy(config)
        setattr(changed, field, True)
        assert not rope.fuses(changed, 16, 16), field
    monkeypatch.setenv(EAGER_ROPE_ENV, "1")
    assert not rope.fuses(config, 16, 16)


def test_rope_cos_sin_once_per_table():
    """The queries and keys of every layer rotate by one table: its cos and sin are computed on the
    first call and reused (each result still upstream's bit for bit); changed in place, they are
    computed anew."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention
    from megatron.core.transformer.transformer_config import TransformerConfig

    apply()
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(24, 2, 4, 16, generator=gen) for _ in range(2))
    freqs = torch.randn(24, 1, 1, 16, generator=gen) * 30
    config, group = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4), SimpleNamespace()

    def ours(t):
        return attention.apply_rotary_pos_emb(t, freqs, config, cp_group=group)

    def upstream(t):
        return rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=group)

    rotated = [ours(t) for t in (q, k)]
    cached = freqs._hetero_cos_sin
    assert all(torch.equal(got, upstream(t)) for got, t in zip(rotated, (q, k)))
    assert torch.equal(ours(q), rotated[0])
    assert freqs._hetero_cos_sin is cached
    freqs.mul_(0.5)
    assert torch.equal(ours(q), upstream(q))
    assert freqs._hetero_cos_sin is not cached


class _Dispatched(TorchDispatchMode):
    """Counts the operators dispatched inside (a foreach call is one, whatever its list's length)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _grads(count: int, dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (7,), (64, 33), (1,)]
    return [torch.randn(shapes[i % len(shapes)], generator=gen).to(dtype) for i in range(count)]


def _dispatched(fn) -> int:
    with _Dispatched() as mode:
        fn()
    return mode.count


def test_grad_norm_reads_nothing_on_the_host():
    """Without TE and apex, clip_grads' gradient norm is upstream's bit for bit (fp32 and bf16
    gradients), and reads no value on the host: it runs on meta tensors, where upstream's cannot."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    apply()
    for dtype in (torch.float32, torch.bfloat16):
        grads = _grads(6, dtype)
        got = clip_grads.l2_norm_impl(0, None, [grads], False)
        want = local_multi_tensor_l2_norm(0, None, [grads], False)
        assert torch.equal(got[0], want[0]) and got[0].dtype == torch.float32 and got[1] is None
    on_meta = [torch.empty(4, 3, device="meta"), torch.empty(5, device="meta")]
    assert clip_grads.l2_norm_impl(0, None, [on_meta], False)[0].shape == (1,)
    with pytest.raises(RuntimeError, match="item"):
        local_multi_tensor_l2_norm(0, None, [on_meta], False)


def test_optimizer_step_loops_are_upstreams_in_a_fixed_number_of_operators():
    """The clip's scale (in place, as clip_grads calls it, and from one list into another; bf16 lists
    take upstream's loop) and the copy of fp32 main params into bf16 weights are upstream's bit for bit,
    and with the norm dispatch as many operators for 40 parameters as for 4 (upstream: one to three per
    parameter)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as optimizer_module
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    apply()
    upstream_copy = optimizer_module._multi_tensor_copy_this_to_that.__wrapped__
    for dtype in (torch.float32, torch.bfloat16):
        grads, want = _grads(6, dtype), _grads(6, dtype)
        clip_grads.multi_tensor_scale_impl(0, None, [grads, grads], 0.37)
        local_multi_tensor_scale(0, None, [want, want], 0.37)
        assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))
        src, got, want = _grads(6, torch.float32, seed=1), _grads(6, dtype), _grads(6, dtype)
        optimizer_module.multi_tensor_scale_impl(0, None, [src, got], 1.0)
        local_multi_tensor_scale(0, None, [src, want], 1.0)
        assert all(torch.equal(g, w) and g.dtype == dtype for g, w in zip(got, want, strict=True))
    main, weights, want = _grads(6, torch.float32, seed=2), _grads(6, torch.bfloat16), _grads(6, torch.bfloat16)
    optimizer_module._multi_tensor_copy_this_to_that(main, weights)
    upstream_copy(main, want)
    assert all(torch.equal(w, v) for w, v in zip(weights, want, strict=True))
    assert not any(torch.equal(w, m.bfloat16()) for w, m in zip(_grads(6, torch.bfloat16), main))  # it copied

    def ops(count: int, upstream: bool) -> list[int]:
        grads, weights = _grads(count, torch.float32), _grads(count, torch.bfloat16)
        norm = local_multi_tensor_l2_norm if upstream else clip_grads.l2_norm_impl
        scale = local_multi_tensor_scale if upstream else clip_grads.multi_tensor_scale_impl
        copy_ = upstream_copy if upstream else optimizer_module._multi_tensor_copy_this_to_that
        return [_dispatched(lambda: norm(0, None, [grads], False)),
                _dispatched(lambda: scale(0, None, [grads, grads], 0.5)),
                _dispatched(lambda: copy_(grads, weights))]
    assert ops(4, upstream=False) == ops(40, upstream=False)
    assert all(few < many for few, many in zip(ops(4, upstream=True), ops(40, upstream=True)))


def test_device_drawn_weights_are_one_full_tensor_sliced():
    """An init method marked DeviceDrawn: megatron-core's CPU initialization draws the full master weight
    on that device (here the CPU, the code path a GPU takes) from a generator seeded by one draw of the
    default CPU generator; every TP rank keeps its slice of that one tensor (layout-independent), the
    run's seed decides it, and the CPU stream advances by that one draw. Another init method gets
    upstream's draws bit for bit."""
    from megatron.core.tensor_parallel import layers

    from megatron_hetero.models.init import DeviceDrawn
    from megatron_hetero.patches import device_init

    def init(weight):
        return torch.nn.init.normal_(weight, std=0.02)
    apply()
    marked = DeviceDrawn(init, torch.device("cpu"))

    def slices(init_method, world_size, dim=0):
        torch.manual_seed(7)
        shape = [12, 6]
        shape[dim] //= world_size
        out = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(world_size)]
        for rank, weight in enumerate(out):
            torch.manual_seed(7)
            layers._initialize_affine_weight_cpu(weight, 12, 6, shape[dim], dim, init_method,
                                                 params_dtype=torch.bfloat16, rank=rank, world_size=world_size)
        return torch.cat(out, dim), torch.randint(2**30, ())

    whole, after = slices(marked, 1)
    torch.manual_seed(7)
    seed = int(torch.randint(device_init.SEED_RANGE, ()))
    assert after == torch.randint(2**30, ())  # one draw of the CPU stream
    reference = torch.empty(12, 6)
    with device_init.seeded(torch.device("cpu"), seed):
        init(reference)
    assert torch.equal(whole, reference.bfloat16())
    for dim in (0, 1):
        assert torch.equal(slices(marked, 2, dim)[0], whole)
    upstream, _ = slices(init, 1)
    torch.manual_seed(7)
    assert torch.equal(upstream, init(torch.empty(12, 6)).bfloat16()) and not torch.equal(upstream, whole)


def _accumulate_in_linear_layers(rank, world_size):
    """Without apex, after apply(): megatron-core's linear layers take gradient_accumulation_fusion
    (Megatron's default flag survives validation) and accumulate each weight gradient into its
    main_grad over microbatches, equal to autograd's summed gradients; a weight shared with another
    use (zero_out_wgrad, as tied embeddings) keeps the other use's gradient through DDP's hook."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, layers
    from megatron.core.transformer import TransformerConfig

    from megatron_hetero.patches import startup

    apply()
    assert layers._grad_accum_fusion_available
    args = type("Args", (), {"gradient_accumulation_fusion": True})()
    startup.disable_unavailable_fusions(args)
    assert args.gradient_accumulation_fusion
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, gradient_accumulation_fusion=True,
                               use_cpu_initialization=True)
    def init(weight):
        return torch.nn.init.normal_(weight, std=0.1)
    group = dist.group.WORLD
    column = ColumnParallelLinear(8, 12, config=config, init_method=init, bias=False, gather_output=True,
                                  tp_group=group)
    row = RowParallelLinear(12, 8, config=config, init_method=init, bias=False, input_is_parallel=True,
                            skip_bias_add=True, tp_group=group)
    weights = [column.weight, row.weight]
    reference = [w.detach().clone().requires_grad_() for w in weights]
    for w in weights:
        w.main_grad = torch.zeros_like(w)
        w.grad_added_to_main_grad = False
    row.weight.zero_out_wgrad = True
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # microbatches
        x = torch.randn(5, 2, 8, generator=gen)
        out, _ = row(column(x)[0])
        # The row weight's second use, as an embedding's lookup beside the output layer.
        (out.square().sum() + (row.weight * 0.5).sum()).backward()
        for w in weights:  # DDP's hook
            assert w.grad_added_to_main_grad
            if w.grad is not None and getattr(w, "zero_out_wgrad", False):
                w.main_grad.add_(w.grad)
            w.grad = None
        hidden = x @ reference[0].t()
        ((hidden @ reference[1].t()).square().sum() + (reference[1] * 0.5).sum()).backward()
    for w, want in zip(weights, reference):
        torch.testing.assert_close(w.main_grad, want.grad)


def test_gradient_accumulation_fusion_without_apex():
    run_distributed(_accumulate_in_linear_layers, 1)


def test_fused_adam(monkeypatch):
    """The optimizer megatron-core builds (its torch AdamW inside a wrapper) runs torch's fused kernel,
    also after loading a state saved by the foreach one, and steps as the foreach reference does.
    Here on the CPU, where torch has the fused kernel too (the patch keeps CPU runs on foreach)."""
    from megatron_hetero.patches import fused_adam

    monkeypatch.setattr(fused_adam, "DEVICE_TYPES", ("cpu",))
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in start] for _ in range(4)]

    def adamw(foreach: bool):
        params = [p.clone().requires_grad_() for p in start]
        return torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, foreach=foreach)

    reference = adamw(foreach=True)
    wrapper = type("Float16Optimizer", (), {})()
    wrapper.optimizer = adamw(foreach=True)
    built = fused_adam._fused(lambda config, model_chunks, param_groups: wrapper)(None, None, None)
    assert built is wrapper

    def step(optimizer, i):
        for p, g in zip(optimizer.param_groups[0]["params"], grads[i]):
            p.grad = g.clone()
        optimizer.step()

    inner = wrapper.optimizer
    for i in range(2):
        assert inner.param_groups[0]["fused"] and not inner.param_groups[0]["foreach"]
        step(inner, i), step(reference, i)
    inner.load_state_dict(copy.deepcopy(reference.state_dict()))  # a checkpoint of a foreach run
    for i in range(2, 4):
        assert inner.param_groups[0]["fused"] and not inner.param_groups[0]["foreach"]
        step(inner, i), step(reference, i)
    for p, want in zip(inner.param_groups[0]["params"], reference.param_groups[0]["params"]):
        torch.testing.assert_close(p, want, rtol=1e-6, atol=1e-6)
    assert all(state["step"].item() == 4 for state in inner.state.values())


SCRIPT_AT_EXIT = """
import atexit, os, sys
import torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))  # runs last
from megatron_hetero.patches import cpu
cpu.apply()
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # a port of its own, taken at once
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
if sys.argv[1] == "raise":
    raise RuntimeError("the run failed")
"""


@pytest.mark.parametrize("ending, destroyed", [("clean", True), ("raise", False)])
def test_process_groups_destroyed_at_a_clean_exit(ending, destroyed):
    """On CPUs (gloo), a run that ends well destroys its process groups at exit (gloo's threads
    otherwise abort it now and then); one that ends in an exception leaves them."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", SCRIPT_AT_EXIT, ending], capture_output=True,
                            text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == (0 if destroyed else 1), result.stderr[-2000:]
    assert f"initialized at exit: {not destroyed}" in result.stdout, result.stdout[-2000:]


def test_help_prints_megatrons_flags_and_ours():
    """--help formats every flag's help: megatron-core 0.19 documents one flag with a bare %, which
    argparse's formatting refuses; the patched parser escapes it and keeps %(default)s fields."""
    import argparse

    from megatron.training import arguments

    apply()
    parser = argparse.ArgumentParser(prog="pretrain_vlm.py")
    arguments.add_megatron_arguments(parser)
    parser.add_argument("--with-default", default=7, help="default %(default)s, 100%% of it")
    text = parser.format_help()
    assert "--moe-paged-stash-buffer-size-factor-cuda" in text and "--hetero-layout" in text
    assert "default 7, 100% of it" in text
    upstream = argparse.ArgumentParser()
    arguments.add_megatron_arguments.__wrapped__(upstream)
    with pytest.raises(ValueError, match="unsupported format character"):
        upstream.format_help()
