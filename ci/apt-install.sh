#!/usr/bin/env bash
# Install Debian packages for espnet3-flows' make targets, or say exactly how to.
#
# Usage: ci/apt-install.sh WHY PACKAGE...
#
# As root: `apt-get update` + `apt-get install -y PACKAGE...`, all output to a log file
# ($ESPNET3_APT_LOG, default ~/.cache/espnet3-flows/apt.log); on failure the log's tail is
# printed and the exit status is 1. Not root: prints the one `apt-get install` line to run and
# exits 1 at once, so `make` stops before anything else is attempted.
set -uo pipefail

why="$1"; shift
log="${ESPNET3_APT_LOG:-$HOME/.cache/espnet3-flows/apt.log}"

if [[ "$(id -u)" != 0 ]]; then
    echo "error: $why needs the Debian packages: $*" >&2
    echo "       install them once as root:  sudo apt-get install -y $*" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: $why needs the Debian packages $*, and this machine has no apt-get;" \
         "install their equivalents with your package manager" >&2
    exit 1
fi

mkdir -p "$(dirname "$log")"
echo "[apt] installing $* for $why (log: $log)" >&2
{
    echo "=== $(date -u +%FT%TZ) apt-get install $*"
    export DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1
    apt-get update -q && apt-get install -y -q "$@"
} >>"$log" 2>&1
status=$?
if [[ $status != 0 ]]; then
    echo "error: apt-get install $* failed (exit $status); the end of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
fi
