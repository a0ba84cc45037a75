export PYTHONPATH=.
TIMEFORMAT='wall %R s'
rm -rf artifacts
{ nvidia-smi -L; time python -m nsa_validate oneshot --level quick > $OUT/q1.log 2>&1; echo "q1 rc=$?"; } > $OUT/q1.time 2>&1; cat $OUT/q1.time; tail -1 $OUT/q1.log | cut -c1-160
Q=$(ls -td artifacts/*/*/ | head -1); python .dev58/summ.py $Q | grep -v "^  suite\|excl"; cp $Q/manifest.json $OUT/q1-manifest.json
{ time python -m nsa_validate oneshot --level quick > $OUT/q2.log 2>&1; echo "q2 rc=$?"; } > $OUT/q2.time 2>&1; cat $OUT/q2.time; tail -1 $OUT/q2.log | cut -c1-160
Q=$(ls -td artifacts/*/*/ | head -1); python .dev58/summ.py $Q | grep -v "^  suite\|excl"
