import os
if os.environ.get("PRISM_OPLOG"):
    import atexit, sys, json
    sys.path.insert(0, "/work/main")
    from prism_megatron.runtime import fake as F
    from prism_megatron.trace import recorder as R
    c = {"kernel": 0, "free": 0, "other": 0, "gap_host_s": 0.0, "gaps": 0}
    snaps = []
    oa = F.CostClock.account
    def account(self, *a, **k):
        h0 = self.host_s
        oa(self, *a, **k)
        dh = self.host_s - h0
        L = self.model.host_launch_s
        if abs(dh - L) < 1e-12: c["kernel"] += 1
        elif abs(dh - 0.25 * L) < 1e-12: c["free"] += 1
        else: c["other"] += 1
    F.CostClock.account = account
    ohw = F.CostClock.host_work
    def hw(self, gap_s):
        h0 = self.host_s; ohw(self, gap_s); c["gap_host_s"] += self.host_s - h0; c["gaps"] += 1
    F.CostClock.host_work = hw
    ob = R.Recorder.begin_iteration
    def bi(self):
        snaps.append(dict(c)); return ob(self)
    R.Recorder.begin_iteration = bi
    def dump():
        snaps.append(dict(c))
        with open(os.path.join(os.environ["PRISM_OPLOG"], "ops-%d.json" % os.getpid()), "w") as f:
            json.dump(snaps, f)
    atexit.register(dump)
