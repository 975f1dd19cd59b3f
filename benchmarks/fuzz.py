"""Random layouts for the layout fuzzer (tests/test_fuzz_layouts.py, benchmarks/fuzz_layouts.py).

`random_case(rng)` draws what a user could hand tools/verify_layout.py: a layout file (placement,
1-3 encoders, TP/CP/DP/PP sizes, the LLM's EP/ETP, rank ranges, frozen flags, sp), a world size of 1-12, and the
batch: images per sample (0 included), tokens per image, global batch size. Sizes are mostly drawn
so that they fit (products that divide the world, contiguous rank ranges) and then, with some
probability, broken in one of the ways users break them, so that both valid and invalid layouts
come up often. `rng` is a `random.Random` (hypothesis' `st.randoms()` provides one too).
"""

import contextlib
import io
import os
import random
from dataclasses import dataclass

import yaml

AXES = ("tp", "cp", "dp", "pp")
ENCODER_NAMES = ("vision", "audio", "video")


@dataclass
class Case:
    """One fuzzer input: a layout file's content, the world size, verify_layout's batch flags."""

    spec: dict
    world_size: int
    flags: list[str]

    def layout_text(self) -> str:
        return yaml.safe_dump(self.spec, sort_keys=False)

    def __str__(self) -> str:
        return f"world size {self.world_size}, flags {' '.join(self.flags)}:\n{self.layout_text()}"


def _factor(rng: random.Random, n: int) -> dict:
    """Sizes over AXES whose product is n: each prime factor of n goes to a random axis (size-1 axes
    are left out, or written as 1 now and then)."""
    sizes = dict.fromkeys(AXES, 1)
    p = 2
    while n > 1:
        while n % p:
            p += 1
        sizes[rng.choice(AXES)] *= p
        n //= p
    return {a: s for a, s in sizes.items() if s > 1 or rng.random() < 0.2}


def _module(rng: random.Random, role: str, size: int) -> dict:
    spec = {"role": role, **_factor(rng, size)}
    if role == "encoder" and rng.random() < 0.3:
        spec["freeze"] = True
    if role == "llm" and spec.get("tp", 1) > 1 and rng.random() < 0.5:
        spec["sp"] = True
    if role == "llm" and rng.random() < 0.3:  # experts over the dense ranks: ep x etp divides tp x cp x dp
        dense = spec.get("tp", 1) * spec.get("cp", 1) * spec.get("dp", 1)
        spec["ep"] = rng.choice([d for d in range(1, dense + 1) if dense % d == 0])
        spec["etp"] = rng.choice([d for d in range(1, dense // spec["ep"] + 1) if dense // spec["ep"] % d == 0])
    elif rng.random() < 0.05:  # encoders are dense: refused unless 1
        spec[rng.choice(["ep", "etp"])] = rng.choice([1, 2])
    return spec


def _cuts(rng: random.Random, world: int, parts: int) -> list[range] | None:
    """`parts` contiguous non-empty rank ranges covering 0..world-1 (None if world < parts)."""
    if world < parts:
        return None
    cuts = sorted(rng.sample(range(1, world), parts - 1))
    bounds = [0, *cuts, world]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


# Ways users break a layout (applied to a layout that may be valid).
def _break(rng: random.Random, spec: dict, world: int) -> None:
    modules = spec["modules"]
    name = rng.choice(list(modules))
    module = modules[name]
    how = rng.randrange(12)
    if how == 0:
        module[rng.choice(AXES)] = rng.choice([0, -1, 3, 5, "2", 1.5, True])
    elif how == 1:
        module["role"] = rng.choice(["llm", "decoder", None])
    elif how == 2:
        module["ranks"] = rng.choice([f"0-{world}", f"{world}-{world + 1}", "2-1", "x", 3])
    elif how == 3:
        module[rng.choice(["sp", "freeze"])] = rng.choice([True, "yes", 1])
    elif how == 4:
        module[rng.choice(["tpp", "dp_size", "layers"])] = 2
    elif how == 5:
        spec["edges"] = rng.choice([[], [f"{name} -> {name}"], ["nowhere -> llm"], "vision -> llm"])
    elif how == 6:
        spec["placement"] = rng.choice(["colocated", "non_colocated", "mixed", None])
    elif how == 7:
        module.pop("role")
    elif how == 8:
        module["cp"] = module.get("cp", 1) * 2
    elif how == 9:
        modules[rng.choice(["1bad", "bad-name", "llm"])] = dict(module)
    elif how == 10:
        module[rng.choice(["ep", "etp"])] = rng.choice([2, 4])
    else:
        module["pp"] = module.get("pp", 1) * 2


def random_case(rng: random.Random, max_world: int = 12) -> Case:
    world = rng.randint(1, max_world)
    placement = rng.choice(["colocated", "non_colocated"])
    encoders = list(ENCODER_NAMES[:rng.randint(1, 3)])
    names = [*encoders, "llm"]
    ranges = _cuts(rng, world, len(names)) if placement == "non_colocated" else None
    modules = {}
    for i, name in enumerate(names):
        role = "llm" if name == "llm" else "encoder"
        if ranges is None:
            modules[name] = _module(rng, role, world)
            if placement == "non_colocated":  # too few ranks for disjoint modules: ranks anyway
                modules[name]["ranks"] = "0-0"
        else:
            modules[name] = _module(rng, role, len(ranges[i]))
            modules[name]["ranks"] = f"{ranges[i].start}-{ranges[i].stop - 1}"
    spec = {"placement": placement, "modules": modules}
    if len(encoders) > 1 or rng.random() < 0.5:
        spec["edges"] = [f"{e} -> llm" for e in encoders]
    if rng.random() < 0.3:
        _break(rng, spec, world)
    images = [rng.randint(0, 3) for _ in range(rng.randint(1, 4))]
    flags = ["--images-per-sample", *map(str, images), "--tokens-per-image", str(rng.randint(1, 20))]
    if rng.random() < 0.5:
        flags += ["--global-batch-size", str(rng.randint(1, 24))]
    return Case(spec, world, flags)


def dry_run(verify_main, case: Case, path) -> tuple[int, str]:
    """tools/verify_layout.py's `main` on `case` with --dry-run, in this process as WORLD_SIZE ranks:
    (exit code, what it wrote to stderr). An exception out of it propagates (a bug)."""
    path.write_text(case.layout_text())
    err = io.StringIO()
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    os.environ.update(WORLD_SIZE=str(case.world_size), RANK="0")
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = verify_main([str(path), *case.flags, "--dry-run"])
    finally:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return code, err.getvalue()


def one_error_line(code: int, stderr: str) -> bool:
    """What a user mistake must give: exit code 2, one `error: ...` line, no traceback (torch's own
    start-up warnings aside)."""
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    return code == 2 and len(lines) == 1 and "Traceback" not in stderr
