"""`megatron-hetero layout check|show FILE --world-size N [--model-sizes MODEL_JSON]` (also `python -m
megatron_hetero.layout`): a layout file validated (spec/layout.py) and its rank map printed; `show`
adds each module's process groups. With a model.json (hf import) the layout is checked as training
checks it: encoder kinds the model builds, each encoder's CP against its items, heads and layers that divide over each
module's tp and pp, and the family's vision stages and DeepStack edges (so this command sits above
families/)."""

import argparse
import sys

from megatron_hetero.cli.picture import PictureError, draw_layout
from megatron_hetero.families import UnknownFamilyError, encoder_cp_tokens, encoder_stage_problem, family_named
from megatron_hetero.models.kinds import UnknownKindError, encoder_kind
from megatron_hetero.spec import rules
from megatron_hetero.spec.layout import HeteroLayout, LayoutError, ModuleLayout, load_layout
from megatron_hetero.spec.sizes import ModelSizes, read_model_description, sizes_from_dict

AXES = ("tp", "cp", "dp", "pp")


def main(argv: list[str] | None = None, prog: str = "python -m megatron_hetero.layout") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Check a heterogeneous parallel layout file and print its rank map.",
        fromfile_prefix_chars="@")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, what in (("check", "validate FILE and print which module coordinates each rank holds"),
                       ("show", "as check, and list every module's tp/cp/dp/pp process groups")):
        command = commands.add_parser(name, help=what, description=what)
        command.add_argument("file", metavar="FILE", help="layout YAML file")
        command.add_argument("--world-size", type=int, required=True, metavar="N", help="number of ranks")
        command.add_argument("--model-sizes", metavar="MODEL_JSON", help="a model.json (hf import): check the "
                             "layout against the model as training does (encoder kinds, encoder CP against the items, "
                             "heads and layers per tp and pp, DeepStack edges) and print the llm stage that adds "
                             "each edge")
        if name == "show":
            command.add_argument("--png", metavar="FILE", help="also draw the layout into this PNG file "
                                 "(ranks, each module's coordinates and TP groups, the edges; needs matplotlib)")
    args = parser.parse_args(argv)
    try:
        layout = load_layout(args.file, args.world_size)
        edges = _model_checks(layout, args.model_sizes) if args.model_sizes else []
        if getattr(args, "png", None):
            draw_layout(layout, args.png)
    except (LayoutError, PictureError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    groups = [group_lines(m) for m in layout.modules] if args.command == "show" else []
    print("\n".join([layout.rank_map(), *edges, *(line for lines in groups for line in lines)]))
    return 0


def group_lines(module: ModuleLayout) -> list[str]:
    """One line per axis of size > 1: the module's groups along it (ranks sharing every other coordinate)."""
    coords = {rank: module.coords(rank) for rank in module.ranks}
    lines = []
    for axis in AXES:
        if getattr(module, axis) == 1:
            continue
        groups: dict[tuple, list[int]] = {}
        for rank, c in coords.items():
            if c is not None:
                groups.setdefault(tuple(c[a] for a in AXES if a != axis), []).append(rank)
        lines.append(f"{module.name} {axis} groups: " + " ".join(f"[{','.join(map(str, g))}]" for g in groups.values()))
    return lines


def _model_checks(layout: HeteroLayout, model_file: str) -> list[str]:
    """The layout against a model.json as training checks it (training/args.py: the same rules); the
    model's DeepStack edges, a line each."""
    try:
        sizes = sizes_from_dict(read_model_description(model_file, f"--model-sizes {model_file}")["sizes"])
    except ValueError as error:
        raise LayoutError(f"{error}; give the model.json of hf import") from None
    try:
        family = family_named(sizes.family) if sizes.family else None
    except UnknownFamilyError as error:
        raise LayoutError(f"--model-sizes {model_file}: {error}") from None
    moe = sizes.llm_arch.moe
    problems = [rules.llm_freeze_problem(layout.llm), *_size_problems(layout.llm, sizes, "", model_file),
                rules.experts_problem(layout.llm, moe.num_experts if moe else None, moe.topk if moe else 1)]
    for module in layout.encoders:
        try:
            kind = encoder_kind(module)
        except UnknownKindError as error:
            raise LayoutError(str(error)) from None
        problems += [rules.encoder_cp_problem(module, encoder_cp_tokens(module, sizes)),
                     rules.encoder_pp_problem(module, layout.placement), encoder_stage_problem(module, sizes),
                     *_size_problems(module, sizes, f"{kind.flag_prefix}_", model_file)]
    deepstack = family.deepstack(sizes) if family else ()
    vision = next((m.name for m in layout.encoders if m.kind == "vision"), "vision")
    rules.check(LayoutError, *problems, rules.deepstack_problem(layout, vision, deepstack))
    return rules.deepstack_stages(layout.llm, vision, deepstack, sizes.num_layers)


def _size_problems(module: ModuleLayout, sizes: ModelSizes, prefix: str, model_file: str) -> list[str | None]:
    """Heads over the module's tp and layers over its pp, named by the model.json's fields."""
    def field(name: str) -> tuple[int, str]:
        return getattr(sizes, prefix + name), f"{model_file}'s {prefix}{name}"

    return [rules.heads_problem(module, *field("num_attention_heads")),
            rules.stages_problem(module, *field("num_layers"))]


if __name__ == "__main__":
    sys.exit(main())
