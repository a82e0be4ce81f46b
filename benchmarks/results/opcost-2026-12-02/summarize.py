"""Summarize opstat/sitecustomize.py's files: per process (virtual or realtime sandbox), per operation
and dim, calls, median host us, total ms, and the calls that began with the device idle.

    python summarize.py FOLDER
"""

import glob
import json
import os
import sys


def main() -> None:
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "opstat-*.json"))):
        d = json.load(open(path))
        argv = d["argv"]
        config = argv[argv.index("--prism-config") + 1] if "--prism-config" in argv else "?"
        mode = d.get("mode", "?")
        print(f"== {os.path.basename(path)} {mode} {config}")
        print(f"{'op/dim':>40} {'calls':>6} {'med us':>8} {'sum ms':>8} {'idle':>6} {'idle med':>9} {'idle ms':>8}")
        tot = idle = 0.0
        for key, v in sorted(d["ops"].items(), key=lambda kv: -kv[1]["sum_s"]):
            med = v["idle_median_us"]
            print(f"{key:>40} {v['n']:6d} {v['median_us']:8.1f} {v['sum_s'] * 1e3:8.2f} {v['idle_n']:6d} "
                  f"{med if med is not None else float('nan'):9.1f} {v['idle_sum_s'] * 1e3:8.2f}")
            if not key.startswith("recorder."):
                tot += v["sum_s"]
                idle += v["idle_sum_s"]
        print(f"{'backend total':>40} {'':6} {'':8} {tot * 1e3:8.2f} {'':6} {'':9} {idle * 1e3:8.2f}")


if __name__ == "__main__":
    main()
