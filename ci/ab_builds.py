"""Interleaved A/B of two builds of the package on the standard workloads.

    python ci/ab_builds.py --builds old=.gpu/base,new=.gpu/site --workloads W1,W3,F1 \
        --rounds 3 --out $OUT/ab.md

Two builds cannot share a process (both are `sparseforge`), so each (round, build) is one
process that imports the build from its directory and times the workloads with
sparseforge.bench.run_workload, cuDNN dense SDPA in the same process. The order of the
builds alternates from round to round (ABBA...). Prints and writes a table of effective
TFLOPS and the ratio to cuDNN per round, and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, sys
from sparseforge.bench import WORKLOADS, run_workload
KEYS = ("workload", "path", "tflops", "dense_tflops", "err", "quant_ms")
for name in sys.argv[1].split(","):
    row = run_workload(WORKLOADS[name], iters=int(sys.argv[2]))
    print("ROW " + json.dumps({k: row[k] for k in KEYS}))
"""


def run_build(path: str, workloads: str, iters: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, workloads, str(iters)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout
    return [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", required=True, help="name=dir,name=dir")
    parser.add_argument("--workloads", default="W1,W3,F1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    builds = [tuple(item.split("=", 1)) for item in args.builds.split(",")]
    results = []  # (round, build, row)
    for r in range(args.rounds):
        for name, path in builds if r % 2 == 0 else builds[::-1]:
            for row in run_build(path, args.workloads, args.iters):
                results.append((r, name, row))
                quant = "" if row["quant_ms"] is None else f", quantizer {row['quant_ms']:.3f} ms"
                print(
                    f"round {r} {name} {row['workload']}: {row['tflops']:.0f} TFLOPS, "
                    f"cuDNN {row['dense_tflops']:.0f}, err {row['err']:.2e}{quant}",
                    flush=True,
                )
    names = [name for name, _ in builds]
    lines = [
        "| workload | round | " + " | ".join(f"{n} TFLOPS (ratio to cuDNN)" for n in names) + " |",
        "| --- | --- |" + " --- |" * len(names),
    ]
    for workload in args.workloads.split(","):
        per_build = {n: [] for n in names}
        for r in range(args.rounds):
            cells = []
            for n in names:
                row = next(
                    x for rr, nn, x in results if rr == r and nn == n and x["workload"] == workload
                )
                per_build[n].append(row)
                cells.append(f"{row['tflops']:.0f} ({row['tflops'] / row['dense_tflops']:.3f})")
            lines.append(f"| {workload} | {r} | " + " | ".join(cells) + " |")
        medians = [
            f"{statistics.median(x['tflops'] for x in per_build[n]):.0f} "
            f"({statistics.median(x['tflops'] / x['dense_tflops'] for x in per_build[n]):.3f})"
            for n in names
        ]
        lines.append(f"| {workload} | median | " + " | ".join(medians) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
