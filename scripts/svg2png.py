#!/usr/bin/env python3
"""A Textual/Rich SVG screenshot as a PNG (cairosvg: ``pip install -e '.[test]'`` brings it).

Why not the SVG as it is: it names the Fira Code web font and spaces the text with ``textLength`` and
non-breaking spaces, which browsers honour and cairo does not (runs of spaces shrink, so a time axis's
"now" lands mid-plot). The copy handed to cairo names a monospace font this machine has (DejaVu Sans Mono,
Debian's fonts-dejavu-core) and keeps plain spaces with xml:space="preserve"; nothing else changes.

    scripts/svg2png.py IN.svg OUT.png [--scale 1.0]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

FONT = "DejaVu Sans Mono"


def prepare(svg: str) -> str:
    svg = svg.replace("Fira Code, monospace", f"{FONT}, monospace").replace('"Fira Code"', f'"{FONT}"')
    svg = svg.replace("&#160;", " ")
    return svg.replace("<svg ", '<svg xml:space="preserve" ', 1)


def svg_to_png(src: Path, dst: Path, scale: float = 1.0) -> Path:
    import cairosvg
    cairosvg.svg2png(bytestring=prepare(Path(src).read_text()).encode(), write_to=str(dst), scale=scale)
    return Path(dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--scale", type=float, default=1.0)
    a = ap.parse_args()
    if not a.src.is_file():
        print(f"svg2png: {a.src}: no such file", file=sys.stderr)
        return 2
    print(f"wrote {svg_to_png(a.src, a.dst, a.scale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
