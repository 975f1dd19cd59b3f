"""Loss curves of Megatron-LM logs side by side, as a PNG (Pillow: no plotting library needed), and
per log the median iteration time of its last 100 iterations.

    python benchmarks/plot_curves.py --png docs/curves.png NAME=LOG [NAME=LOG ...] [--log-scale]

A log is what megatron.training prints with --log-interval 1: lines `iteration N/ M | ... elapsed
time per iteration (ms): T | ... lm loss: L | ...`.
"""

import argparse
import math
import re
import statistics

from PIL import Image, ImageDraw

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+).*lm loss: ([\d.E+-]+)")
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]


def read_log(path: str) -> list[tuple[int, float, float]]:
    """(iteration, ms, loss) of every logged iteration."""
    with open(path) as f:
        return [(int(m[1]), float(m[2]), float(m[3])) for m in map(LINE.search, f) if m]


def draw(curves: dict[str, list], png: str, log_scale: bool, size=(900, 500), margin=60) -> None:
    width, height = size
    value = (lambda y: math.log10(y)) if log_scale else (lambda y: y)
    xs = [x for rows in curves.values() for x, _, _ in rows]
    ys = [value(y) for rows in curves.values() for _, _, y in rows]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    image = Image.new("RGB", size, "white")
    pen = ImageDraw.Draw(image)
    at = lambda x, y: (margin + (x - x0) / max(x1 - x0, 1) * (width - 2 * margin),  # noqa: E731
                       height - margin - (value(y) - y0) / max(y1 - y0, 1e-9) * (height - 2 * margin))
    pen.rectangle([margin, margin, width - margin, height - margin], outline="black")
    pen.text((margin, 10), "lm loss per iteration" + (" (log scale)" if log_scale else ""), fill="black")
    pen.text((margin, height - margin + 8), f"iteration {x0}", fill="black")
    pen.text((width - margin - 80, height - margin + 8), f"iteration {x1}", fill="black")
    top, bottom = (10**y1, 10**y0) if log_scale else (y1, y0)
    pen.text((4, margin - 6), f"{top:.3g}", fill="black")
    pen.text((4, height - margin - 6), f"{bottom:.3g}", fill="black")
    for i, (name, rows) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        pen.line([at(x, y) for x, _, y in rows], fill=color, width=2)
        pen.text((width - margin - 220, margin + 10 + 16 * i), name, fill=color)
    image.save(png)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", metavar="NAME=LOG")
    parser.add_argument("--png", required=True)
    parser.add_argument("--log-scale", action="store_true")
    opts = parser.parse_args()
    curves = {name: read_log(path) for name, path in (item.split("=", 1) for item in opts.logs)}
    for name, rows in curves.items():
        last = [ms for _, ms, _ in rows[-100:]]
        print(f"{name}: {len(rows)} iterations, median of the last {len(last)}: {statistics.median(last):.1f} ms, "
              f"loss {rows[0][2]:.4f} -> {rows[-1][2]:.4f}")
    draw(curves, opts.png, opts.log_scale)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
