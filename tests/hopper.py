"""Our Triton kernels compiled for Hopper (sm90) by Triton's own ptxas, without a GPU: what the CPU
interpreter cannot see (registers, shared memory, the layouts Triton picks for the GPU)."""

import pytest


def hopper_cubin(kernel, signature: dict, constexprs: dict, **options) -> bytes:
    """`kernel` (a @triton.jit function) with its arguments' types (`signature`: name -> "*bf16", "i32",
    ...) and `constexprs` (name -> value, typed "constexpr"), compiled for sm90 with `options` (num_warps,
    ...), every argument typed, in the kernel's order: its cubin. The test skips where Triton does not
    import."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    assert set(types) == set(kernel.arg_names), set(types) ^ set(kernel.arg_names)
    source = ASTSource(kernel, {name: types[name] for name in kernel.arg_names}, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options or None).asm["cubin"]
