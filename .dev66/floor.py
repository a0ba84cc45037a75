import sys, os
sys.path.insert(0, os.getcwd())
import torch
from kernels import decode as D
from nsa_validate.measure import timing
for rows in (4, 64):
    for n in (1, 2, 3, 5):
        f = D.launch_floor("cuda", rows, n)
        r = [round(timing.bench(f, device="cuda", graph=True, budget_ms=200, min_reps=5, max_reps=200,
                                telemetry=False, l2_flush=fl).median_ms * 1e3, 2) for fl in (True, True, False)]
        print("rows", rows, "launches", n, "flush,flush,noflush", r, flush=True)
