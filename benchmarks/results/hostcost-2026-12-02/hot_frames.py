"""Where a process's host time goes, from py-spy raw stacks (`py-spy record --format raw`): per
process, the samples; then, over the samples of the processes whose command line holds MATCH, the
inclusive and self counts per frame, for all samples and for those inside the prism backend's
operation wrapper (comm/ops.py `run`) or the recorder (trace/recorder.py).

    python hot_frames.py SPY.txt [MATCH] [TOP] > hot.txt
"""

from __future__ import annotations

import collections
import re
import sys


def _records(path: str):
    """The file's records: a command line given with `-c` spans several lines; a record ends with
    a frame or a command's closing quote, then its count."""
    buf = []
    for line in open(path, errors="replace"):
        buf.append(line.rstrip("\n"))
        if re.search(r"[)\"] \d+$", buf[-1]):
            yield " ".join(buf)
            buf = []


def main() -> None:
    path = sys.argv[1]
    match = sys.argv[2] if len(sys.argv) > 2 else "emulate"
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    per_process = collections.Counter()
    scopes = {"all": (collections.Counter(), collections.Counter()),
              "backend": (collections.Counter(), collections.Counter()),
              "recorder": (collections.Counter(), collections.Counter())}
    totals = collections.Counter()
    for line in _records(path):
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        cmd = re.sub(r"\s+", " ", procs[-1])[:140] if procs else "?"
        per_process[cmd] += n
        if match not in cmd:
            continue
        code = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not code:
            continue
        names = [re.sub(r":\d+\)$", ")", f) for f in code]  # a frame without its line
        inside = {"all": True,
                  "backend": any(f.endswith("run (prism_megatron/comm/ops.py)") for f in names),
                  "recorder": any("prism_megatron/trace/recorder.py" in f for f in names)}
        for scope, yes in inside.items():
            if not yes:
                continue
            inc, own = scopes[scope]
            totals[scope] += n
            for f in set(names):
                inc[f] += n
            own[code[-1]] += n
    print("samples per process")
    for cmd, n in per_process.most_common(12):
        print(f"{n:8d}  {cmd}")
    for scope, (inc, own) in scopes.items():
        t = max(1, totals[scope])
        print(f"\n== {scope}: {totals[scope]} samples\n-- inclusive")
        for f, n in inc.most_common(top):
            print(f"{n:8d} {100 * n / t:5.1f}%  {f}")
        print("-- self (with line)")
        for f, n in own.most_common(top):
            print(f"{n:8d} {100 * n / t:5.1f}%  {f}")


if __name__ == "__main__":
    main()
