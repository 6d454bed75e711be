"""Interleaved A/B of two builds of the package on the standard workloads.

    python ci/ab_builds.py --builds old=.gpu/base,new=.gpu/site --workloads W1,W3,F1 \
        --rounds 3 --out $OUT/ab.md
    python ci/ab_builds.py --builds old=.gpu/base,new=.gpu/site --workloads SDSA --rounds 2 \
        [--sdsa-keys nvfp4]
    python ci/ab_builds.py --builds main=python@.gpu/libs/main,new=.gpu/newpy@.gpu/libs/new ...

(a build as DIR@LIB: the package in DIR with the development library LIB of a few
variants, `python -m generator.dev`).

Two builds cannot share a process (both are `sparseforge`), so each (round, build) is one
process that imports the build from its directory and times the workloads with
sparseforge.bench.run_workload, cuDNN dense SDPA in the same process (SDSA: every SD1 / SD2
line of sparseforge.bench.sdsa_times, in microseconds and share of HBM). The order of the
builds alternates from round to round (ABBA...). Prints and writes a table per round and
the medians: effective TFLOPS and the ratio to cuDNN, or microseconds and HBM share.
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


# SDSA: each line of sdsa_times as a row whose "workload" is the line up to its time, less
# the count of repaired rows (which the builds need not share).
SDSA_CHILD = """
import json, re, sys
from sparseforge.bench import sdsa_times
for line in sdsa_times(iters=int(sys.argv[2]), keys=tuple(sys.argv[3].split(","))):
    what, us, share = re.match(r"(.*?): ([0-9.]+) us .*?([0-9]+)% of HBM", line).groups()
    what = re.sub(r" [(][0-9]+ rows repaired[)]", "", what)
    print("ROW " + json.dumps({"workload": what, "us": float(us), "hbm": int(share)}))
"""


def run_build(build: str, workloads: str, iters: int, sdsa_keys: str) -> list[dict]:
    """One process of a build, DIR[@LIB]: the `sparseforge` package in DIR, with the kernel
    library of directory LIB if given (SPARSEFORGE_LIBRARY_DIR), else the package's own."""
    package, _, library = build.partition("@")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(package))
    env.pop("SPARSEFORGE_LIBRARY_DIR", None)
    if library:
        env["SPARSEFORGE_LIBRARY_DIR"] = os.path.abspath(library)
    child = SDSA_CHILD if workloads == "SDSA" else CHILD
    done = subprocess.run(
        [sys.executable, "-c", child, workloads, str(iters), sdsa_keys],
        env=env,
        capture_output=True,
        text=True,
        cwd="/",
    )
    if done.returncode:  # the child's error (a bad --sdsa-keys, a missing build) named
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"build {build} failed (exit {done.returncode}):\n{tail}")
    return [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--builds",
        required=True,
        help="name=DIR[@LIB],...: DIR holds the sparseforge package (a build's site directory, "
        "or a checkout's python/), LIB a kernel library directory (python -m generator.dev "
        "... --out LIB) to use instead of the package's own",
    )
    parser.add_argument("--workloads", default="W1,W3,F1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sdsa-keys", default="bf16,nvfp4", help="key formats for SDSA")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    builds = [tuple(item.split("=", 1)) for item in args.builds.split(",")]
    results = []  # (round, build, row)
    for r in range(args.rounds):
        for name, path in builds if r % 2 == 0 else builds[::-1]:
            for row in run_build(path, args.workloads, args.iters, args.sdsa_keys):
                results.append((r, name, row))
                print(f"round {r} {name} {describe(row)}", flush=True)
    table = ab_table(results, [name for name, _ in builds], args.rounds)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


def describe(row: dict) -> str:
    if "us" in row:
        return f"{row['workload']}: {row['us']:.1f} us, {row['hbm']}% of HBM"
    quant = "" if row["quant_ms"] is None else f", quantizer {row['quant_ms']:.3f} ms"
    return (
        f"{row['workload']}: {row['tflops']:.0f} TFLOPS, cuDNN {row['dense_tflops']:.0f}, "
        f"err {row['err']:.2e}{quant}"
    )


def ab_table(results: list, names: list[str], rounds: int) -> str:
    """Markdown: a row per (workload, round) and the medians, a column per build."""
    timed = "us" in results[0][2]

    def cell(rows: list[dict]) -> str:
        median = statistics.median
        if timed:
            return f"{median(x['us'] for x in rows):.1f} us ({median(x['hbm'] for x in rows):.0f}%)"
        return (
            f"{median(x['tflops'] for x in rows):.0f} "
            f"({median(x['tflops'] / x['dense_tflops'] for x in rows):.3f})"
        )

    unit = "us (share of HBM)" if timed else "TFLOPS (ratio to cuDNN)"
    lines = [
        "| workload | round | " + " | ".join(f"{n} {unit}" for n in names) + " |",
        "| --- | --- |" + " --- |" * len(names),
    ]
    workloads = list(dict.fromkeys(row["workload"] for _, _, row in results))
    for workload in workloads:
        per_build = {n: [] for n in names}
        for r in range(rounds):
            cells = []
            for n in names:
                row = next(
                    x for rr, nn, x in results if rr == r and nn == n and x["workload"] == workload
                )
                per_build[n].append(row)
                cells.append(cell([row]))
            lines.append(f"| {workload} | {r} | " + " | ".join(cells) + " |")
        lines.append(
            f"| {workload} | median | " + " | ".join(cell(per_build[n]) for n in names) + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
