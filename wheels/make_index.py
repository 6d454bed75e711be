"""A PEP 503 simple index next to the wheels: one index for the fat wheel, one per arch.

    python wheels/make_index.py wheelhouse

writes wheelhouse/index/simple/ (the fat wheels: every arch) and wheelhouse/index/<arch>/simple/
(the +<arch> wheels), each with a root page and a sparseforge page whose links carry the
wheels' sha256. The index is chosen by URL, as per-CUDA indexes are for torch:

    pip install sparseforge --index-url file:///.../wheelhouse/index/simple          # all archs
    pip install sparseforge --index-url file:///.../wheelhouse/index/sm90a/simple    # H100/H200

An arch index holds only its arch's wheels, so a plain `pip install sparseforge` against it
cannot pick another arch's (local version labels would otherwise sort +sm90a above +sm120f).
"""

from __future__ import annotations

import argparse
import hashlib
import html
import os
import re
import sys
from pathlib import Path

PROJECT = "sparseforge"


def arch_of(wheel: Path) -> str | None:
    """The arch label of an arch wheel (sparseforge-X.Y.Z+sm90a-...), None for the fat one."""
    match = re.match(rf"{PROJECT}-[^-+]+\+([a-z0-9]+)-", wheel.name)
    return match.group(1) if match else None


def write_index(root: Path, wheels: list[Path]) -> None:
    """root/index.html and root/sparseforge/index.html linking to `wheels` (relative paths)."""
    project = root / PROJECT
    project.mkdir(parents=True, exist_ok=True)
    (root / "index.html").write_text(
        f'<!DOCTYPE html>\n<html><body>\n<a href="{PROJECT}/">{PROJECT}</a>\n</body></html>\n'
    )
    links = []
    for wheel in sorted(wheels):
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        href = os.path.relpath(wheel, project).replace(os.sep, "/")
        links.append(
            f'<a href="{html.escape(href)}#sha256={digest}">{html.escape(wheel.name)}</a><br>'
        )
    (project / "index.html").write_text(
        "<!DOCTYPE html>\n<html><body>\n" + "\n".join(links) + "\n</body></html>\n"
    )


def make_index(wheelhouse: Path) -> dict[str, Path]:
    """{"all" or arch label: index root} for the wheels in `wheelhouse`."""
    wheels = sorted(wheelhouse.glob(f"{PROJECT}-*.whl"))
    if not wheels:
        raise SystemExit(f"no {PROJECT} wheels in {wheelhouse}")
    groups: dict[str, list[Path]] = {}
    for wheel in wheels:
        groups.setdefault(arch_of(wheel) or "all", []).append(wheel)
    roots = {}
    for label, members in groups.items():
        root = wheelhouse / "index" / ("simple" if label == "all" else f"{label}/simple")
        write_index(root, members)
        roots[label] = root
    return roots


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheelhouse", type=Path)
    args = parser.parse_args(argv)
    for label, root in sorted(make_index(args.wheelhouse.resolve()).items()):
        print(f"{label}: file://{root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
