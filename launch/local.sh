#!/bin/bash
# `accelerate launch` on one machine, for a terminal (Ctrl-C), timeout(1), `kill -- -PGID`, a
# container's PID 1 (Kubernetes: SIGTERM to PID 1, SIGKILL after the grace period) or any
# scheduler that signals the whole process group. Every argument goes to `accelerate launch`:
#   launch/local.sh --multi_gpu --num_processes 8 -m vlp train -c configs/gpu_vitb32.yaml ...
#   ACCELERATE_USE_CPU=1 launch/local.sh --multi_gpu --num_processes 2 -m vlp train -c configs/demo.yaml ...
# Guide: docs/reliability.md#how-a-run-stops.
#
# What it adds to a bare `accelerate launch` (torch's elastic agent), whose own handling of a
# signal to the group is: SIGTERM / SIGINT forwarded to the ranks a second time, then a
# SignalException traceback and exit 1 whatever the ranks did; SIGUSR1 not handled, so the
# launcher dies at once (its ranks see it gone, save and exit: vlp.distributed).
# - The launcher runs with SIGTERM, SIGUSR1, SIGINT and SIGHUP ignored (PET_SIGNALS_TO_HANDLE, as in
#   launch/slurm.sbatch): it waits for its ranks, which torch starts each in a session of its
#   own (a signal to this group never reaches them). This script passes each of those signals
#   on to the ranks, once: a Ctrl-C, `kill -- -PGID`, timeout(1), or a signal to this script
#   alone (Kubernetes: PID 1) stops them.
# - The ranks stop at the next step boundary, save, and say it in one line (vlp/train/preempt.py).
#   Their status goes through $VLP_PREEMPT_MARKER, and this script exits 75 after a preemption's
#   save (SIGTERM, SIGUSR1), 130 after a Ctrl-C (saved, or a second one: aborted), 129 after a
#   SIGHUP's save (the terminal closed), 1 when a rank
#   lost its peers, else the launcher's own status.
set -uo pipefail
marker=${VLP_PREEMPT_MARKER:-$(mktemp -u "${TMPDIR:-/tmp}/vlp-stop.XXXXXX")}
export VLP_PREEMPT_MARKER=$marker
export PET_SIGNALS_TO_HANDLE=SIGQUIT
rm -f "$marker"
(trap '' TERM USR1 INT HUP; exec python -m accelerate.commands.launch "$@") &
launcher=$!
pass_on() { pkill "-$1" -P "$launcher" 2>/dev/null || true; }
trap 'pass_on TERM' TERM
trap 'pass_on USR1' USR1
trap 'pass_on INT' INT
trap 'pass_on HUP' HUP
status=0
while :; do
  wait "$launcher"; status=$?
  kill -0 "$launcher" 2>/dev/null || break  # a trap ended the wait, not the launcher's exit
done
why=""
if [ -e "$marker" ]; then why=$(cat "$marker"); rm -f "$marker"; fi
case "$why" in
  "") exit "$status" ;;
  lost-peers) exit 1 ;;
  interrupted*|aborted) exit 130 ;;
  hangup*) exit 129 ;;
  *) exit 75 ;;
esac
