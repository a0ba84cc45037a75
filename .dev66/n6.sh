export PYTHONPATH=.
TIMEFORMAT='wall %R s'
rm -rf artifacts
{ nvidia-smi -L; time python -m nsa_validate oneshot --level quick > $OUT/q1.log 2>&1; echo "q1 rc=$?"; } > $OUT/q1.time 2>&1; cat $OUT/q1.time; tail -1 $OUT/q1.log | cut -c1-160
Q=$(ls -td artifacts/*/*/ | head -1); python .dev58/summ.py $Q | grep -v "^  suite\|excl"
{ time python -m nsa_validate oneshot --level standard > $OUT/s1.log 2>&1; echo "s1 rc=$?"; } > $OUT/s1.time 2>&1; cat $OUT/s1.time; tail -1 $OUT/s1.log | cut -c1-160
Q=$(ls -td artifacts/*/*/ | head -1); python .dev58/summ.py $Q | grep -v "^  suite\|excl"; cp $Q/kernels.jsonl $OUT/sm90-standard.jsonl
python .dev66/m5.py 16x65536 16x131072 32x65536 16x16384 > $OUT/m5.log 2>&1; tail -30 $OUT/m5.log
