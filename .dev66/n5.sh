export PYTHONPATH=.
TIMEFORMAT='wall %R s'
nvidia-smi -L | tee $OUT/gpu.txt
rm -rf artifacts
{ time python -m nsa_validate oneshot --level quick > $OUT/q1.log 2>&1; echo "q1 rc=$?"; } 2>&1 | tee $OUT/q1.time; tail -1 $OUT/q1.log | cut -c1-160
grep "parity\[B16\|bench\[" $OUT/q1.log | cut -c1-120
Q=$(ls -td artifacts/*/*/ | head -1); python .dev58/summ.py $Q | grep -v "^  suite\|excl"; cp $Q/kernels.jsonl $OUT/sm90-quick.jsonl; cp $Q/report.md $OUT/q1-report.md
grep -i "warm" $OUT/q1-report.md | head -5
rm -rf ~/.triton/cache
{ time python -m nsa_validate oneshot --level standard > $OUT/s1.log 2>&1; echo "s1 rc=$?"; } 2>&1 | tee $OUT/s1.time; tail -1 $OUT/s1.log | cut -c1-160
Q=$(ls -td artifacts/*/*/ | head -1); python .dev58/summ.py $Q | grep -v "^  suite\|excl"; cp $Q/kernels.jsonl $OUT/sm90-standard.jsonl; cp $Q/report.md $OUT/s1-report.md
grep -i "warm" $OUT/s1-report.md | head -5
{ time timeout 150 python -m pytest -q -p no:cacheprovider tests/nsa/test_decode_kernel.py tests/nsa/test_decode_compile.py > $OUT/t.log 2>&1; echo "t rc=$?"; } 2>&1 | tee $OUT/t.time; tail -2 $OUT/t.log
python - <<'PY' 2>&1 | grep -v Warn
import torch, kernels.decode as D
from nsa_validate.bench.decode import layer_config
cfg = layer_config(True)
for B in (16, 32, 8):
    p = D.plan(cfg, B, 2 * 65536, cfg.n_cmp(2 * 65536 - 1), "cuda", torch.bfloat16)
    print(B, p.win_tiles, p.sel_tiles, p.win_stages, p.C_WIN, p.C_SEL)
print(D._FITS)
PY
