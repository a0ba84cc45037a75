#!/usr/bin/env bash
# examples/slurm/submit.sh COUNT [SBATCH OPTIONS...]
# Validates COUNT nodes: validate.sbatch as an array of COUNT tasks (each a whole node), then
# merge.sbatch once they have all ended (--dependency=afterany), which writes the fleet report and
# exits non-zero when a node failed or its run is missing. SBATCH OPTIONS (partition, account, qos)
# go to both jobs. The variables of validate.sbatch (NSA_OUT required, NSA_VALIDATE, NSA_PROFILE,
# NSA_LEVEL, NSA_GPUS, NSA_SELECT, NSA_ARGS) are read from this shell's environment.
# Prints the two job ids (`validate: job N`, `merge: job M`) and where the runs, logs and report go.
set -euo pipefail

usage() { echo "usage: NSA_OUT=/shared/folder $0 COUNT [SBATCH OPTIONS...]" >&2; exit 2; }
if [ $# -lt 1 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then usage; fi
count=$1; shift
: "${NSA_OUT:?set NSA_OUT to a folder every node can write (a shared file system)}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NSA_OUT=$(mkdir -p "$NSA_OUT" && cd "$NSA_OUT" && pwd)       # absolute: the jobs may start elsewhere
export NSA_OUT
export NSA_SLURM_DIR=$here                                # healthcheck.sh, for NSA_DRAIN=1
logs="$NSA_OUT/slurm-logs"
mkdir -p "$logs"                                          # Slurm does not create an --output folder

job=$(sbatch --parsable --array="0-$((count - 1))" --output="$logs/validate-%A_%a.out" "$@" \
      "$here/validate.sbatch")
job=${job%%;*}                                            # "id;cluster" on a multi-cluster setup
echo "validate: job $job (array 0-$((count - 1))), runs under $NSA_OUT/slurm-$job, logs $logs/validate-${job}_<task>.out"
merge=$(sbatch --parsable --dependency="afterany:$job" --kill-on-invalid-dep=no \
        --export="ALL,NSA_JOB=$job,NSA_COUNT=$count" --output="$logs/merge-%j.out" "$@" \
        "$here/merge.sbatch")
merge=${merge%%;*}
echo "merge: job $merge (after job $job ends), report under $NSA_OUT/slurm-$job/fleet/, log $logs/merge-$merge.out"
