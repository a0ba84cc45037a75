export PYTHONPATH=.
TIMEFORMAT='wall %R s'
rm -rf artifacts
{ nvidia-smi -L; time python -m nsa_validate oneshot --level quick > $OUT/q1.log 2>&1; echo "q1 rc=$?"; } > $OUT/q1.time 2>&1; cat $OUT/q1.time; tail -1 $OUT/q1.log | cut -c1-160
Q=$(ls -td artifacts/*/*/ | head -1); python .dev58/summ.py $Q | grep -v "^  suite\|excl"; grep -o "Prewarm:[^.]*\.[^.]*\." $Q/report.md | head -2
python .dev66/floor.py 2>&1 | grep -v Warn | tee $OUT/floor.log
