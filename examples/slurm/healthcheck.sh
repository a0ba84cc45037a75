#!/usr/bin/env bash
# examples/slurm/healthcheck.sh [oneshot OPTIONS...]
# An option for admins: validate this node, and drain it when the check fails, with the verdict's
# first blocking line as the reason:
#   scontrol update NodeName=<node> State=DRAIN Reason="nsa-validate: <first blocking line>"
# Runs `$NSA_VALIDATE oneshot OPTIONS --json`; without OPTIONS, `--level quick --gpus all --out $NSA_OUT`.
# Exit status: oneshot's (0 pass, 1 fail, 2 usage, 3 environment broken), drained or not. Draining
# takes Slurm admin rights: run it as root (cron, a systemd timer, a Prolog) or as SlurmUser; a
# validate job submitted with NSA_DRAIN=1 runs each node's oneshot through it. README.md: the options.
#
# Variables:
#   NSA_VALIDATE    the command (default: nsa-validate), split on spaces
#   NSA_OUT         run folders' root when no OPTIONS are given (default: /var/tmp/nsa-validate)
#   NSA_GPUS        --gpus when no OPTIONS are given (default: all; empty on a CPU-only node)
#   NSA_DRAIN_NODE  the node to drain (default: $SLURMD_NODENAME, else `hostname -s`)
#   NSA_DRAIN       1 (default) drains on failure; 0 only prints the reason it would give
#   NSA_HC_EVERY    seconds: exit 0 at once when this node passed less than that long ago (default 0:
#                   check every time); for a Prolog, so that not every job waits for a check
set -uo pipefail
export PATH=${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}    # a Prolog gets none

NSA_VALIDATE=${NSA_VALIDATE:-nsa-validate}
NSA_OUT=${NSA_OUT:-/var/tmp/nsa-validate}
NSA_GPUS=${NSA_GPUS-all}
NSA_DRAIN=${NSA_DRAIN:-1}
NSA_HC_EVERY=${NSA_HC_EVERY:-0}
node=${NSA_DRAIN_NODE:-${SLURMD_NODENAME:-$(hostname -s)}}
REASON_MAX=200                    # characters of the drain reason (scontrol/sinfo -R show it whole)

stamp="${TMPDIR:-/tmp}/nsa-validate-healthcheck-$node.passed"
if [ "$NSA_HC_EVERY" -gt 0 ] && [ -f "$stamp" ] \
        && [ $(( $(date +%s) - $(stat -c %Y "$stamp") )) -lt "$NSA_HC_EVERY" ]; then
    exit 0
fi

if [ $# -eq 0 ]; then
    set -- oneshot --level quick --out "$NSA_OUT" ${NSA_GPUS:+--gpus "$NSA_GPUS"}
fi
[ "$1" = oneshot ] || { echo "usage: $0 [oneshot OPTIONS...]" >&2; exit 2; }

json=$(mktemp)
trap 'rm -f "$json"' EXIT
# shellcheck disable=SC2086  # NSA_VALIDATE is split on spaces on purpose
$NSA_VALIDATE "$@" --json >"$json"
rc=$?
cat "$json"                        # the run's JSON, as oneshot --json prints it
if [ "$rc" -eq 0 ]; then
    touch "$stamp" 2>/dev/null
    exit 0
fi
rm -f "$stamp"

# the verdict's first blocking line; else its headline, oneshot's error, or the bare exit status
line=$(python3 - "$json" "$rc" <<'EOF'
import json, sys
try:
    out = json.loads(open(sys.argv[1], encoding="utf-8", errors="replace").read())
except ValueError:
    out = {}
out = out if isinstance(out, dict) else {}
verdict = out.get("verdict") or {}
line = ((verdict.get("blocking") or [None])[0] or verdict.get("headline") or out.get("error")
        or f"exit {sys.argv[2]} without a verdict")
print(" ".join(str(line).split()))        # one line: scontrol takes the reason as one argument
EOF
)
[ -n "$line" ] || line="exit $rc without a verdict"
reason="nsa-validate: $line"
[ ${#reason} -le $REASON_MAX ] || reason="${reason:0:$((REASON_MAX - 3))}..."

if [ "$NSA_DRAIN" = 1 ]; then
    if scontrol update NodeName="$node" State=DRAIN Reason="$reason"; then
        echo "healthcheck: drained $node: $reason" >&2
    else
        echo "healthcheck: could not drain $node (Slurm admin rights?): $reason" >&2
    fi
else
    echo "healthcheck: would drain $node (NSA_DRAIN=0): $reason" >&2
fi
exit "$rc"
