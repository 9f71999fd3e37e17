#!/usr/bin/env bash
# Start (or confirm) a single-node SLURM cluster for espnet3-flows tests and CI.
#
# Usage:   eval "$(ci/slurm/start.sh)"        # exports SLURM_CONF in the calling shell
#    or:   ci/slurm/start.sh >/dev/null && . "${ESPNET3_SLURM_DIR:-/tmp/espnet3-flows-slurm}/env.sh"
# Stop:    ci/slurm/stop.sh
#
# stdout carries only `export SLURM_CONF=...` (so the eval form works); progress and errors go
# to stderr. The same line is written to $ESPNET3_SLURM_DIR/env.sh.
#
# Needs root (SlurmUser=root, munged started as the munge user). Installs `slurm-wlm munge`
# with apt-get when slurmctld is missing. Idempotent: daemons already running are left alone.
#
# Environment:
#   ESPNET3_SLURM_DIR          state dir (default /tmp/espnet3-flows-slurm): slurm.conf, env.sh,
#                              state/ spool/ log/ run/ (pid files; run/munged.pid only when
#                              this script started munged, so stop.sh stops only what we began)
#   ESPNET3_SLURM_TIMEOUT      seconds to wait for the node to become idle (default 60)
#   ESPNET3_SLURM_MEM_MARGIN_MB memory kept back from RealMemory (default max(1024, 10%))
#   ESPNET3_SLURMCTLD_PORT / ESPNET3_SLURMD_PORT   (defaults 6817 / 6818)
#
# Dask on this cluster: the node is NodeName=localhost NodeAddr=127.0.0.1, but Dask does not
# care: dask_jobqueue.SLURMCluster's scheduler listens on all interfaces and advertises the
# machine's outward address (distributed.utils.get_ip(), e.g. 192.0.2.2 here), and workers,
# which run on this same machine, reach it there. So SLURMCluster(cores=1, memory="1GB",
# processes=1, queue="debug", walltime="00:10:00") works with no interface option (measured).
# scheduler_options={"interface": "lo"} also works (scheduler on tcp://127.0.0.1:PORT) and is
# the choice for a host without a default route (get_ip() then falls back to the hostname's
# address, else 127.0.0.1). Workers pick their own address by the route to the scheduler.
# Never force "lo" on a real multi-node cluster: workers on other nodes could not reach it.
#
# A fresh start (no daemon running) clears slurmctld's saved jobs (-c): their processes were
# killed by stop.sh, and restored phantom jobs would hold the node. DefMemPerCPU=1024 in the
# template keeps `sbatch --wrap` jobs without --mem from taking the whole node's memory.
set -euo pipefail

DIR="${ESPNET3_SLURM_DIR:-/tmp/espnet3-flows-slurm}"
TIMEOUT="${ESPNET3_SLURM_TIMEOUT:-60}"
CTLD_PORT="${ESPNET3_SLURMCTLD_PORT:-6817}"
SLURMD_PORT="${ESPNET3_SLURMD_PORT:-6818}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TEMPLATE="$HERE/slurm.conf.in"
CONF="$DIR/slurm.conf"

log() { echo "[slurm/start] $*" >&2; }
die() { echo "[slurm/start] ERROR: $*" >&2; exit 1; }

# pid_alive PIDFILE COMM: the pid in PIDFILE is a live process named COMM (guards pid reuse).
pid_alive() {
    local pid
    [[ -s "$1" ]] || return 1
    pid="$(tr -dc '0-9' <"$1")"
    [[ -n "$pid" && -r "/proc/$pid/comm" ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]]
}

show_logs() {
    local f
    for f in "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" /var/log/munge/munged.log; do
        [[ -f "$f" ]] || continue
        echo "----- tail of $f -----" >&2
        tail -n 25 "$f" >&2 || true
    done
}

[[ "$(id -u)" == 0 ]] || die "must run as root (SlurmUser=root; munged runs as user munge)"
[[ -f "$TEMPLATE" ]] || die "template not found: $TEMPLATE"

if ! command -v slurmctld >/dev/null 2>&1; then
    "$HERE/../apt-install.sh" "a single-node SLURM cluster" slurm-wlm munge \
        || die "slurm-wlm munge could not be installed"
fi
for exe in slurmctld slurmd sinfo munged munge unmunge; do
    command -v "$exe" >/dev/null 2>&1 || [[ -x "/usr/sbin/$exe" ]] || die "$exe missing after install"
done
MUNGED="$(command -v munged || echo /usr/sbin/munged)"

mkdir -p "$DIR"/{state,spool,log,run}
chmod 755 "$DIR"

export SLURM_CONF="$CONF"
CTLD_UP=0; SLURMD_UP=0
pid_alive "$DIR/run/slurmctld.pid" slurmctld && CTLD_UP=1
pid_alive "$DIR/run/slurmd.pid" slurmd && SLURMD_UP=1

if [[ $CTLD_UP == 0 && $SLURMD_UP == 0 ]]; then
    # Render only when nothing runs: rewriting a live daemon's config would be a trap.
    cpus="$(nproc)"
    mem_mb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 ))
    margin="${ESPNET3_SLURM_MEM_MARGIN_MB:-$(( mem_mb / 10 > 1024 ? mem_mb / 10 : 1024 ))}"
    real_mem=$(( mem_mb - margin ))
    (( real_mem >= 256 )) || die "too little memory for a node: MemTotal ${mem_mb} MB, margin ${margin} MB"
    sed -e "s|@DIR@|$DIR|g" -e "s|@CPUS@|$cpus|g" -e "s|@REAL_MEMORY@|$real_mem|g" \
        -e "s|@SLURMCTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" \
        "$TEMPLATE" >"$CONF.tmp"
    if grep -q '@[A-Z_]*@' "$CONF.tmp"; then die "unsubstituted placeholder in $CONF.tmp"; fi
    mv "$CONF.tmp" "$CONF"
    log "rendered $CONF (CPUs=$cpus RealMemory=${real_mem}MB)"
fi

# munge: reuse a working munged; otherwise start one and remember that it is ours.
if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munged already answers"
else
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null 2>&1; then
            runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
        else
            create-munge-key -f
        fi
    fi
    mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
    runuser -u munge -- "$MUNGED" || { show_logs; die "munged failed to start"; }
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 || { show_logs; die "munged does not answer"; }
    cp /run/munge/munged.pid "$DIR/run/munged.pid"
    log "started munged (pid $(cat "$DIR/run/munged.pid"))"
fi

if [[ $CTLD_UP == 1 ]]; then
    log "slurmctld already running (pid $(cat "$DIR/run/slurmctld.pid"))"
else
    # Fresh start (-c): jobs saved by an earlier run have no processes any more (stop.sh
    # killed them); restoring them would show phantom RUNNING jobs holding the node.
    clear=()
    [[ $SLURMD_UP == 0 ]] && clear=(-c)
    slurmctld "${clear[@]}" -f "$CONF" || { show_logs; die "slurmctld failed to start"; }
    log "started slurmctld"
fi
if [[ $SLURMD_UP == 1 ]]; then
    log "slurmd already running (pid $(cat "$DIR/run/slurmd.pid"))"
else
    slurmd -f "$CONF" -N localhost || { show_logs; die "slurmd failed to start"; }
    log "started slurmd"
fi

deadline=$(( SECONDS + TIMEOUT ))
resumed=0
state=""
while :; do
    state="$(sinfo -h -N -n localhost -o %T 2>/dev/null | head -n1 || true)"
    case "$state" in
        idle|mixed|allocated|completing) break ;;
        down*|drain*|fail*)
            if [[ $resumed == 0 ]]; then
                log "node is '$state'; asking slurmctld to resume it"
                scontrol update NodeName=localhost State=RESUME 1>&2 || true
                resumed=1
            fi ;;
    esac
    if (( SECONDS >= deadline )); then
        show_logs
        die "node localhost not idle after ${TIMEOUT}s (sinfo state: '${state:-no answer}')"
    fi
    sleep 0.5
done
log "node localhost is $state"

echo "export SLURM_CONF=$CONF" >"$DIR/env.sh"
echo "export SLURM_CONF=$CONF"
