# In-process cold A/B of one all-reduce in a prism group of 8: python cold_allreduce_ab.py REPO PORT
# (REPO: the checkout to import, first on the path), 12 blocks of 60 calls, each after a matmul and a dict build.
import os, sys, time, statistics, tempfile, gc, json
repo=sys.argv[1]; sys.path.insert(0, repo)
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", MASTER_PORT=sys.argv[2])
import torch, torch.distributed as dist
import prism_megatron
from prism_megatron.config import load_config
from prism_megatron.comm.backend import PrismGroup
world=8
trace=os.path.join(tempfile.mkdtemp(),"c.prism")
inst=prism_megatron.install(load_config(["train.device=cpu",f"emulation.virtual_world_size={world}","emulation.sandbox_ranks=[0]",f"train.global_batch_size={2*world}",f"trace.path={trace}"]))
dist.init_process_group(backend="gloo")
pg=[o for o in gc.get_objects() if isinstance(o, PrismGroup)][0]
t=torch.ones(1024)
a=torch.randn(384,384)
def thrash():
    (a@a).sum(); return {i:str(i) for i in range(3000)}
rec=inst.recorder; rec.begin_iteration()
log=pg.session.log
def timed(fn):
    def run():
        t0=time.perf_counter(); fn(); return time.perf_counter()-t0
    return run
items=[("dist.all_reduce", timed(lambda: dist.all_reduce(t))), ("pg.allreduce", timed(lambda: pg.allreduce([t])))]
res={k:[] for k,_ in items}
h0=log.host_s; n0=0
for block in range(12):
    for name,fn in items:
        tot=0
        for _ in range(60):
            thrash(); tot+=fn()
        res[name].append(tot/60*1e6)
    rec.begin_iteration()
out={name: sorted(v)[len(v)//4] for name,v in res.items()}
out.update({name+" median": statistics.median(v) for name,v in res.items()})
print(json.dumps(out))
rec.iterations.clear(); inst.recorder=None
