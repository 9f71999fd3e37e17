#!/usr/bin/env bash
# Stop the single-node SLURM cluster started by ci/slurm/start.sh and leave nothing running.
#
# Order: cancel every job (so Dask workers and slurmstepd exit cleanly), stop slurmd, then
# slurmctld, kill any job process or slurmstepd of *this* cluster that outlived them (found by
# SLURM_CONF=$ESPNET3_SLURM_DIR/slurm.conf in its environment), and stop munged only if start.sh
# started it. Safe to run when nothing is running. Exits non-zero if a process survives.
#
# Environment: ESPNET3_SLURM_DIR (default /tmp/espnet3-flows-slurm), ESPNET3_SLURM_STOP_TIMEOUT
# (seconds per stage before SIGKILL, default 20).
set -uo pipefail

DIR="${ESPNET3_SLURM_DIR:-/tmp/espnet3-flows-slurm}"
TIMEOUT="${ESPNET3_SLURM_STOP_TIMEOUT:-20}"
CONF="$DIR/slurm.conf"
export SLURM_CONF="$CONF"

log() { echo "[slurm/stop] $*" >&2; }

# pid_of PIDFILE COMM: print the pid if it is a live process named COMM (guards pid reuse).
pid_of() {
    local pid
    [[ -s "$1" ]] || return 1
    pid="$(tr -dc '0-9' <"$1")"
    [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]] || return 1
    echo "$pid"
}

# wait_gone SECONDS PID...: true once all PIDs have exited.
wait_gone() {
    local limit=$(( SECONDS + $1 )); shift
    local p alive
    while :; do
        alive=0
        for p in "$@"; do [[ -d "/proc/$p" ]] && alive=1; done
        [[ $alive == 0 ]] && return 0
        (( SECONDS >= limit )) && return 1
        sleep 0.2
    done
}

# terminate NAME PID: SIGTERM, wait, SIGKILL.
terminate() {
    local name="$1" pid="$2"
    kill -TERM "$pid" 2>/dev/null || return 0
    if wait_gone "$TIMEOUT" "$pid"; then
        log "$name (pid $pid) stopped"
    else
        log "$name (pid $pid) ignored SIGTERM for ${TIMEOUT}s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null
        wait_gone 5 "$pid"
    fi
}

# Job processes and slurmstepd of this cluster: their environment names our slurm.conf.
# The caller's own shell may have SLURM_CONF exported too, so require a job id or slurmstepd.
cluster_leftovers() {
    local d pid env comm
    for d in /proc/[0-9]*; do
        pid="${d#/proc/}"
        [[ "$pid" == "$$" || "$pid" == "$BASHPID" ]] && continue
        env="$( { tr '\0' '\n' <"$d/environ"; } 2>/dev/null)" || continue
        [[ -n "$env" ]] || continue
        grep -qxF "SLURM_CONF=$CONF" <<<"$env" || continue
        comm="$(cat "$d/comm" 2>/dev/null)"
        if [[ "$comm" == slurmstepd ]] || grep -q '^SLURM_JOB_ID=' <<<"$env"; then
            echo "$pid"
        fi
    done
}

ctld="$(pid_of "$DIR/run/slurmctld.pid" slurmctld || true)"
slurmd_pid="$(pid_of "$DIR/run/slurmd.pid" slurmd || true)"

if [[ -n "$ctld" ]]; then
    jobs="$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')"
    if [[ -n "${jobs// /}" ]]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        limit=$(( SECONDS + TIMEOUT ))
        while [[ -n "$(squeue -h -o %i 2>/dev/null)" ]] && (( SECONDS < limit )); do sleep 0.5; done
    fi
fi

[[ -n "$slurmd_pid" ]] && terminate slurmd "$slurmd_pid"
[[ -n "$ctld" ]] && terminate slurmctld "$ctld"

left="$(cluster_leftovers | tr '\n' ' ')"
if [[ -n "${left// /}" ]]; then
    log "killing job processes left behind: $left"
    # shellcheck disable=SC2086
    kill -TERM $left 2>/dev/null
    # shellcheck disable=SC2086
    wait_gone 5 $left || kill -KILL $left 2>/dev/null
fi

if munged_pid="$(pid_of "$DIR/run/munged.pid" munged)"; then
    terminate munged "$munged_pid"
fi
rm -f "$DIR/run/munged.pid"

status=0
for f in slurmctld slurmd munged; do
    if p="$(pid_of "$DIR/run/$f.pid" "$f")"; then log "still running: $f (pid $p)"; status=1; fi
done
left="$(cluster_leftovers | tr '\n' ' ')"
if [[ -n "${left// /}" ]]; then log "still running job processes: $left"; status=1; fi
[[ $status == 0 ]] && log "stopped"
exit $status
