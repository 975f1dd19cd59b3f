"""`python -m megatron_hetero.layout check FILE --world-size N [--model-sizes MODEL_JSON]`: a layout
file validated (spec/layout.py) and its rank map printed; with a model.json, the model's DeepStack
edges checked against the layout's (spec/rules.py; the model's edges are its family's, so this command
sits above families/)."""

import argparse
import json
import sys

from megatron_hetero.families import family_named
from megatron_hetero.spec.layout import HeteroLayout, LayoutError, load_layout
from megatron_hetero.spec.rules import deepstack_problem, deepstack_stages
from megatron_hetero.spec.sizes import sizes_from_dict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_hetero.layout",
        description="Check a heterogeneous parallel layout file and print its rank map.",
        fromfile_prefix_chars="@",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate FILE and print which module coordinates each rank holds")
    check.add_argument("file", metavar="FILE", help="layout YAML file")
    check.add_argument("--world-size", type=int, required=True, metavar="N", help="number of ranks")
    check.add_argument("--model-sizes", metavar="MODEL_JSON", help="a model.json (hf import): check the layout's "
                       "DeepStack edges against the model's and print the llm stage that adds each")
    args = parser.parse_args(argv)
    try:
        layout = load_layout(args.file, args.world_size)
        edges = _model_edges(layout, args.model_sizes) if args.model_sizes else []
    except LayoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join([layout.rank_map(), *edges]))
    return 0


def _model_edges(layout: HeteroLayout, model_file: str) -> list[str]:
    """The model's DeepStack edges (a VLM family's, model.json) checked against the layout's; a line each."""
    try:
        with open(model_file, encoding="utf-8") as f:
            sizes = sizes_from_dict(json.load(f)["sizes"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise LayoutError(f"--model-sizes {model_file}: {error}; give the model.json of hf import") from None
    deepstack = family_named(sizes.family).deepstack(sizes) if sizes.family else ()
    vision = next((m.name for m in layout.encoders if m.kind == "vision"), "vision")
    if sizes.num_layers % layout.llm.pp:
        raise LayoutError(f"model.json's num_layers {sizes.num_layers} is not divisible by module "
                          f"{layout.llm.name}'s pp={layout.llm.pp}; use a divisor")
    problem = deepstack_problem(layout, vision, deepstack)
    if problem:
        raise LayoutError(problem)
    return deepstack_stages(layout.llm, vision, deepstack, sizes.num_layers)


if __name__ == "__main__":
    sys.exit(main())
