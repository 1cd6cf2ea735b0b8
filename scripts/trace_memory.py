"""Where a command's memory goes: its process tree sampled every --period seconds, per process.

Runs COMMAND (everything after ``--``) and reads, every sample, ``/proc/<pid>/smaps_rollup`` of
the command and each of its descendants: PSS split into anonymous, shared-memory (``MAP_SHARED``
anonymous mappings such as the checkers' staging areas and the codecs' shared areas) and file
pages, and the process's private pages (USS: what it alone maps, which ending it would free). At the end it prints the tree's peak PSS, when it happened, and the processes alive then
with their share, then each process's life span and own peak. quantpress's workers name
themselves (``qp-check-0``, ``qp-codec-1``, ``qp-metadata``: ``quantpress.workers.lifecycle.
name_process``), so the rows say which job holds what.

PSS splits each shared page between the processes that map it, so the rows add up to the tree's
total and forked workers are not counted twice. Reading PSS walks a process's page tables: do not
sample much oftener than every 0.1 s, or the sampling slows the command it measures.

Example (SmolLM2-135M to Q4_K_M; the figures and their discussion are in docs/benchmarks.md)::

    .venv/bin/python scripts/trace_memory.py -- .venv/bin/python -m quantpress convert \\
        hf-to-gguf ~/.cache/quantpress/models/SmolLM2-135M-Instruct --policy Q4_K_M \\
        -o /tmp/q.gguf --quiet --force

``--json FILE`` also writes every sample.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

FIELDS = ("Pss", "Pss_Anon", "Pss_Shmem", "Pss_File", "Private_Clean", "Private_Dirty")


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (from ``/proc/<pid>/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            pass
    return out


def rollup(pid: int) -> dict[str, float] | None:
    """The PSS fields (MiB) of one process and its name, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            name = f.read().strip()
        got = {}
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in FIELDS:
                    got[key] = int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    if "Pss" not in got:        # a zombie
        return None
    row = {"name": name, **{k: got.get(k, 0.0) for k in FIELDS}}
    row["Private"] = row.pop("Private_Clean") + row.pop("Private_Dirty")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--period", type=float, default=0.2, help="seconds between samples (default 0.2)")
    ap.add_argument("--json", help="also write every sample here")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command (give it after --)")

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    samples = []
    while proc.poll() is None:
        t = time.perf_counter() - t0
        rows = {p: r for p in tree(proc.pid) if (r := rollup(p)) is not None}
        if rows:
            samples.append((t, rows))
        time.sleep(args.period)
    wall = time.perf_counter() - t0
    if not samples:
        print(f"exit {proc.returncode} after {wall:.1f} s: no sample taken")
        return proc.returncode or 1

    def total(rows: dict) -> float:
        return sum(r["Pss"] for r in rows.values())

    t_peak, at_peak = max(samples, key=lambda s: total(s[1]))
    print(f"exit {proc.returncode}, {wall:.1f} s, {len(samples)} samples; "
          f"peak tree PSS {total(at_peak):.0f} MiB at {t_peak:.1f} s")
    print(f"{'pid':>8} {'process':16} {'PSS':>7} {'anon':>7} {'shmem':>7} {'file':>7} {'private':>8}"
          "   (MiB, at the peak)")
    for pid, r in sorted(at_peak.items(), key=lambda kv: -kv[1]["Pss"]):
        print(f"{pid:>8} {r['name'][:16]:16} {r['Pss']:7.0f} {r['Pss_Anon']:7.0f} "
              f"{r['Pss_Shmem']:7.0f} {r['Pss_File']:7.0f} {r['Private']:8.0f}")
    life: dict[int, list] = {}
    for t, rows in samples:
        for pid, r in rows.items():
            e = life.setdefault(pid, [r["name"], t, t, 0.0])
            e[0], e[2], e[3] = r["name"], t, max(e[3], r["Pss"])
    print(f"\n{'pid':>8} {'process':16} {'from':>6} {'to':>6} {'own peak':>9}   (s, MiB)")
    for pid, (name, a, b, peak) in sorted(life.items(), key=lambda kv: kv[1][1]):
        print(f"{pid:>8} {name[:16]:16} {a:6.1f} {b:6.1f} {peak:9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": cmd, "wall_s": wall, "exit": proc.returncode,
                       "samples": [{"t": t, "processes": {str(p): r for p, r in rows.items()}}
                                   for t, rows in samples]}, f)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
