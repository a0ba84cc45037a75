export PYTHONPATH=.
TIMEFORMAT='wall %R s'
rm -rf artifacts ~/.triton/cache
{ nvidia-smi -L; time python -m nsa_validate oneshot --level quick > $OUT/q1.log 2>&1; echo "q1 rc=$?"; } > $OUT/q1.time 2>&1; cat $OUT/q1.time; tail -1 $OUT/q1.log | cut -c1-160
Q=$(ls -td artifacts/*/*/ | head -1); python .dev58/summ.py $Q | grep -v "^  suite\|excl"
cd $Q && tar czf $OUT/run.tgz manifest.json results.json kernels.jsonl prewarm logs/prewarm.0.log logs/gpu0_share.jsonl 2>/dev/null; ls -la $OUT
