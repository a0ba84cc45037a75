"""A/B of the window on a side stream (dec_fork.py) against main on 2x caches: harness timing (graph, read flush)
x2 and back-to-back, two rounds; variants NAME=FORK/TOPN_GDC. argv: BxS ..."""
import sys, os, json, importlib.util
sys.path.insert(0, os.getcwd())
import torch
from nsa_validate.bench.decode import make_inputs, layer_config
from nsa_validate.measure import timing
sys.path.insert(0, os.path.join(os.getcwd(), ".dev65"))
from m3 import b2b
cfg = layer_config(True)
def load(name, path):
    spec = importlib.util.spec_from_file_location(f"decode_{name}", path)
    m = importlib.util.module_from_spec(spec); sys.modules[f"decode_{name}"] = m; spec.loader.exec_module(m)
    return m
mods = {"main": load("main", "kernels/decode.py")}
for v in os.environ.get("VARS", "ac3=after_cmp/3,ac4=after_cmp/4,st3=start/3").split(","):
    name, spec = v.split("="); fork, g = spec.split("/")
    m = load(name, ".dev66/dec_fork.py"); m.FORK = fork; m.TOPN_GDC = int(g); mods[name] = m

def three(step, nw):
    f = lambda fl: round(timing.bench(lambda: step(**nw), device="cuda", graph=True, budget_ms=200, min_reps=5,
                                       max_reps=200, telemetry=False, l2_flush=fl).median_ms * 1e3, 1)
    return [f(True), f(True), b2b(step, nw)]

def sums(step, nw):
    r = step(**nw); torch.cuda.synchronize()
    return (int(r.idx.long().sum()), *(int(r.reads[b].sum()) for b in ("cmp", "sel", "win")),
            *(round(float(r.out[b].float().sum()), 3) for b in ("cmp", "sel", "win")))

for B, S in [tuple(map(int, c.split("x"))) for c in sys.argv[1:]]:
    with torch.no_grad():
        c2, n2 = make_inputs(cfg, B, S, torch.bfloat16, "cuda", seed=0, capacity=2 * S)
        c1, n1 = make_inputs(cfg, B, S, torch.bfloat16, "cuda", seed=0)
        var = {"full": (mods["main"].DecodeStep(cfg, c1), n1), **{k: (m.DecodeStep(cfg, c2), n2) for k, m in mods.items()}}
        chk = {k: sums(*v) for k, v in var.items()}
        res = {k: [] for k in var}
        for rnd in range(2):
            for k, v in var.items():
                res[k].append(three(*v))
        print(json.dumps({"B": B, "S": S, "cols": "flush,flush,b2b", **res,
                          "same": len({v for k, v in chk.items() if k != "full"}) == 1, "sums": chk}), flush=True)
        del c2, n2, var, c1, n1
        torch.cuda.empty_cache()
