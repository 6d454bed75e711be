"""Summarise an ncu source-view export: stall reasons, opcode mix, the most stalled SASS.

    ncu --set full -k regex:KERNEL --launch-count 1 -o rep python3 ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python ci/ncu_sass_summary.py sass.csv [rows] [units]

units: how many warp-level executions make one unit of work (for a per-unit instruction
count), e.g. tiles x consumer warps.
"""

import collections
import csv
import re
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(path: str, rows: int = 25, units: int = 0) -> None:
    with open(path) as f:
        table = list(csv.reader(f))
    header, data = table[1], table[2:]
    col = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    samples = sum(number(r[col["Warp Stall Sampling (All Samples)"]]) for r in data)
    executed = sum(number(r[col["Instructions Executed"]]) for r in data)
    print("total samples", samples, "total warp instr executed", executed)
    if units:
        print(f"warp instructions per unit: {executed / units:.1f}")
    by_reason = collections.Counter()
    by_opcode = collections.Counter()
    for r in data:
        for c in stalls:
            by_reason[c] += number(r[col[c]])
        opcode = re.sub(r"^@!?U?P\w+\s+", "", r[col["Source"]].strip()).split(" ")[0].split(".")[0]
        by_opcode[opcode] += number(r[col["Instructions Executed"]])
    print(
        "stall totals (%):",
        [(c, round(v / samples * 100, 1)) for c, v in by_reason.most_common(10)],
    )
    print(
        "executed by opcode (%):",
        [(o, round(v / executed * 100, 1)) for o, v in by_opcode.most_common(25)],
    )
    for r in sorted(data, key=lambda r: -number(r[col["Warp Stall Sampling (All Samples)"]]))[
        :rows
    ]:
        s = number(r[col["Warp Stall Sampling (All Samples)"]])
        reasons = sorted(((number(r[col[c]]), c[6:]) for c in stalls), reverse=True)[:3]
        print(
            f"{s / samples * 100:5.1f}% exec={number(r[col['Instructions Executed']]):.0f} "
            f"{r[col['Source']][:70]:70s} {[(n, round(v / s * 100)) for v, n in reasons if v]}"
        )


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
