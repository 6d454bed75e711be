"""Build the fat wheel (every arch) and one wheel per arch.

    python wheels/build_wheels.py [--out wheelhouse] [--archs sm_90a,sm_100a,sm_120a] [--no-fat]

The fat wheel is `sparseforge-X.Y.Z-py3-none-linux_x86_64.whl`. An arch wheel holds that
arch's kernels only and carries it as a local version label: `sparseforge-X.Y.Z+sm90a-...`
(`pip install sparseforge==X.Y.Z+sm90a`). The builds share one CMake build directory, so a
variant compiled for one wheel is not compiled again for the next.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL_ARCHS = ("sm_90a", "sm_100a", "sm_120a")


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "wheelhouse")
    parser.add_argument("--archs", default=",".join(ALL_ARCHS))
    parser.add_argument("--no-fat", action="store_true", help="only the per-arch wheels")
    args = parser.parse_args(argv)
    archs = [a for a in args.archs.split(",") if a]
    built = []
    if not args.no_fat:
        built.append(build(list(ALL_ARCHS), args.out))
    for arch in archs:
        with tempfile.TemporaryDirectory() as tmp:
            built.append(add_local_label(build([arch], Path(tmp)), arch.replace("_", ""), args.out))
    for wheel in built:
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
