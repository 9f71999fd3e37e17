#!/usr/bin/env bash
# A local Prefect server, the deployments and a process worker, for `make serve / deploy / worker /
# stop` (README, "Deployments"). Each process runs in its own session in the background, with its
# pid and log under $ESPNET3_STACK_DIR (default ~/.cache/espnet3-flows/stack).
#
# Usage: deployments/local-stack.sh serve|deploy|worker|stop|status
# Environment:
#   PREFECT       the prefect executable (the Makefile passes the venv's)
#   PREFECT_PORT  the server's port on 127.0.0.1 (default 4200)
#   ESPNET3_STACK_DIR  pid files and logs
#   ESPNET3_FLOWS_WORKDIR  where relative paths in the worker's runs resolve (default: the
#                 directory `make worker` runs in, the project root)
#   ESPNET3_WORKER_LIMIT   flow runs the worker runs at once (default 2; 0: no limit)
# Run from the project root (`deploy` reads deployments/prefect.yaml there).
set -uo pipefail

PREFECT="${PREFECT:-prefect}"
PORT="${PREFECT_PORT:-4200}"
DIR="${ESPNET3_STACK_DIR:-$HOME/.cache/espnet3-flows/stack}"
URL="http://127.0.0.1:$PORT/api"
PY="$(dirname "$PREFECT")/python"; [[ -x "$PY" ]] || PY=python3
mkdir -p "$DIR"

say() { echo "[stack] $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

alive() {  # alive NAME: the recorded process runs and is still ours (a pid file that outlived a
    # reboot may name another program now: it is dropped, never signalled)
    local pid
    [[ -s "$DIR/$1.pid" ]] || return 1
    pid="$(cat "$DIR/$1.pid")"
    if kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "prefect.* $1 "; then
        return 0
    fi
    rm -f "$DIR/$1.pid"
    return 1
}

healthy() {
    "$PY" - "$URL/health" <<'EOF' 2>/dev/null
import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
except Exception:
    sys.exit(1)
EOF
}

start_bg() {  # start_bg NAME CMD...: in a new session, output to NAME.log
    local name="$1"; shift
    setsid "$@" >"$DIR/$name.log" 2>&1 < /dev/null &
    echo $! >"$DIR/$name.pid"
}

descendants() {  # descendants PID: every process below PID (flow runs start sessions of their own,
    # outside the worker's process group, and are re-parented away once the worker is gone)
    local child
    for child in $(cat /proc/"$1"/task/*/children 2>/dev/null); do echo "$child"; descendants "$child"; done
}

any_running() {  # any_running PID...: whether one of the PIDs still runs (a zombie counts as gone)
    local pid stat
    for pid in "$@"; do
        stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || continue
        stat="${stat##*) }"  # the fields after the command's name, which may hold spaces
        [[ "${stat%% *}" != Z ]] && return 0
    done
    return 1
}

wait_gone() {  # wait_gone TENTHS PID...: until none of the PIDs runs, at most TENTHS tenths of a second
    local tries="$1"; shift
    for ((; tries > 0; tries--)); do any_running "$@" || return 0; sleep 0.1; done
    ! any_running "$@"
}

stop_one() {  # stop_one NAME TENTHS SIGNAL...: each SIGNAL to the process group, each given up to
    # TENTHS tenths of a second; then SIGKILL to whatever is left of it and of every process below it
    local name="$1" grace="$2" pid sig family; shift 2
    alive "$name" || { rm -f "$DIR/$name.pid"; return 0; }
    pid="$(cat "$DIR/$name.pid")"
    for sig in "$@"; do
        family="$pid $(descendants "$pid")"  # before the leader can exit and orphan them
        kill "-$sig" -- "-$pid" 2>/dev/null || kill "-$sig" "$pid" 2>/dev/null
        # shellcheck disable=SC2086
        wait_gone "$grace" $family && break
    done
    # shellcheck disable=SC2086
    if any_running $family; then
        kill -KILL -- "-$pid" 2>/dev/null
        # shellcheck disable=SC2086
        kill -KILL $family 2>/dev/null
        say "$name (pid $pid) killed"
    fi
    rm -f "$DIR/$name.pid"
    say "$name stopped"
}

need_server() {
    healthy || die "no Prefect server answers at $URL: run \`make serve\` first (or set PREFECT_PORT)"
}

case "${1:-}" in
serve)
    if healthy; then say "a Prefect server already answers at $URL"; else
        alive server && die "the server started earlier (pid $(cat "$DIR/server.pid")) does not answer; \`make stop\` first"
        # stream logs to clients: `prefect deployment run --watch` then shows a run's log lines
        # (the cause of a failure) beside its events; Prefect's default streams events only.
        # The event consumers write in batches (one SQL statement per 200 events, not per event:
        # orchestration/local_server.py, SERVER_BATCHING)
        start_bg server env PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED=true PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED=true \
            PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE=200 PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL=1 \
            PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE=200 PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL=1 \
            "$PREFECT" server start --host 127.0.0.1 --port "$PORT"
        for _ in $(seq 240); do healthy && break; alive server || break; sleep 0.5; done
        healthy || { tail -n 30 "$DIR/server.log" >&2; die "the Prefect server did not start (log: $DIR/server.log)"; }
        say "Prefect server at http://127.0.0.1:$PORT (UI), log $DIR/server.log"
    fi
    echo "export PREFECT_API_URL=$URL"
    ;;
deploy)
    need_server
    export PREFECT_API_URL="$URL"
    "$PREFECT" --no-prompt work-pool create espnet3 --type process --overwrite >/dev/null \
        || die "could not create the work pool espnet3"
    "$PREFECT" --no-prompt deploy --all --prefect-file deployments/prefect.yaml >"$DIR/deploy.log" 2>&1 \
        || { tail -n 30 "$DIR/deploy.log" >&2; die "prefect deploy failed (log: $DIR/deploy.log)"; }
    say "deployed: every deployment of deployments/prefect.yaml (collect-stats/collect-stats-nightly's schedule inactive)"
    ;;
worker)
    need_server
    if alive worker; then say "a worker runs already (pid $(cat "$DIR/worker.pid"))"; exit 0; fi
    export PREFECT_API_URL="$URL"
    # relative paths in a run's parameters resolve here (Prefect runs each flow run in a temporary
    # directory it deletes afterwards: deploy_steps.working_directory)
    export ESPNET3_FLOWS_WORKDIR="${ESPNET3_FLOWS_WORKDIR:-$PWD}"
    # At most $ESPNET3_WORKER_LIMIT runs at once; the others wait in the queue. Each run starts its own
    # local cluster sized to this machine, and SQLite takes one writer at a time: a deferred
    # transaction that read before another commits fails at once with "database is locked" (its
    # 60 s busy timeout does not apply to that), answered as 503 and retried by the client 5 times
    # in ~1 minute. Ten runs started together by ten triggers at once: 29 such 503s here, triggers
    # waiting up to 29 s, and one trigger seen running out of retries (docs/deployments.md).
    LIMIT="${ESPNET3_WORKER_LIMIT:-2}"
    [[ "$LIMIT" =~ ^[0-9]+$ ]] || die "ESPNET3_WORKER_LIMIT must be a number of runs (0: no limit), got '$LIMIT'"
    LIMIT_ARGS=(); [[ "$LIMIT" != 0 ]] && LIMIT_ARGS=(--limit "$LIMIT")
    start_bg worker "$PREFECT" worker start --pool espnet3 ${LIMIT_ARGS[@]+"${LIMIT_ARGS[@]}"}
    for _ in $(seq 120); do grep -q "started!" "$DIR/worker.log" 2>/dev/null && break; alive worker || break; sleep 0.5; done
    alive worker || { tail -n 30 "$DIR/worker.log" >&2; die "the worker exited (log: $DIR/worker.log)"; }
    say "worker for pool espnet3 (pid $(cat "$DIR/worker.pid")), log $DIR/worker.log; relative paths in runs resolve in $ESPNET3_FLOWS_WORKDIR; at most ${LIMIT_ARGS[1]:-unlimited} run(s) at once"
    ;;
stop)
    # The worker ignores a first SIGINT or SIGTERM for minutes and kills itself on the second;
    # a flow run it was running (its own session) is killed with it. The server stops on SIGTERM.
    stop_one worker 10 INT INT
    stop_one server 100 TERM
    ;;
status)
    for name in server worker; do
        if alive "$name"; then echo "$name: running (pid $(cat "$DIR/$name.pid"))"; else echo "$name: not running"; fi
    done
    healthy && echo "API: $URL answers" || echo "API: $URL does not answer"
    ;;
*)
    die "usage: $0 serve|deploy|worker|stop|status"
    ;;
esac
