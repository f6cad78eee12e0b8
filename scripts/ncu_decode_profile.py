#!/usr/bin/env python3
"""Per-kernel GPU time of one decode step, from an Nsight Compute CSV.

Make the CSV on a GPU machine (CUDA Graphs off so every kernel is a separate launch ncu can time):

    NEBULA_CUDA_GRAPHS=0 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        nebula bench model --model synth.gguf --backend cuda --contexts 512 --decode 2 > ncu.csv
    python3 scripts/ncu_decode_profile.py ncu.csv [--by-grid]

A pass starts with the embedding lookup (the run's first `get_rows_*` kernel); the script takes the kernels from
that kernel's last launch to the end (the last decode step) and sums their durations by kernel name (and
launch shape with --by-grid). ncu flushes the caches before each kernel and times each alone, so small kernels
read slightly slower than inside a graph replay; the step's total is close to the measured ms/token.
"""
import collections
import csv
import signal
import sys


def main() -> None:
    # Piped into `head`: stop quietly when the reader closes (no BrokenPipeError traceback).
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    by_grid = "--by-grid" in sys.argv[2:]
    header, rows = None, []
    with open(sys.argv[1], newline="") as f:
        for r in csv.reader(f):
            if r and r[0] == "ID":
                header = r
            elif header and len(r) == len(header):
                rows.append(dict(zip(header, r)))
    if not rows:
        sys.exit("no kernel rows in the CSV (did ncu run? see its stderr)")
    # The first lookup of the run is the embedding's (a pass's first kernel); later lookups of other tables (the
    # n-gram table) have other names. The last step starts at the embedding kernel's last launch.
    lookups = [r["Kernel Name"] for r in rows if r["Kernel Name"].startswith("get_rows_")]
    if not lookups:
        sys.exit("no embedding lookup (get_rows_*) in the CSV")
    step = rows[max(i for i, r in enumerate(rows) if r["Kernel Name"] == lookups[0]):]
    total = 0.0
    agg = collections.defaultdict(lambda: [0.0, 0])
    for r in step:
        ns = float(r["Metric Value"].replace(",", ""))
        total += ns
        key = (r["Kernel Name"], r["Grid Size"], r["Block Size"]) if by_grid else r["Kernel Name"]
        agg[key][0] += ns
        agg[key][1] += 1
    print(f"decode step: {len(step)} launches, {total / 1e3:.1f} us of kernel time")
    for key, (ns, count) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        name = " ".join(key) if by_grid else key
        print(f"  {name:<48} {ns / 1e3:8.1f} us {100 * ns / total:5.1f} %  {count:4d} x {ns / count / 1e3:6.2f} us")


if __name__ == "__main__":
    main()
