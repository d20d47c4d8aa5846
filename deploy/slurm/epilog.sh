#!/usr/bin/env bash
# Slurm Epilog: stop this job's stallwatch agent for good and collect its dumps.
#
# SIGTERM, wait up to $STALLWATCH_STOP_TIMEOUT seconds, SIGKILL as a last
# resort; remove the job's pinned recording (the agent leaves it pinned when it
# stops, so that a crashed agent loses nothing); then, if $STALLWATCH_COLLECT_DIR is set, copy the node's dumps (and
# the agent's log) to $STALLWATCH_COLLECT_DIR/$SLURM_JOB_ID/, each file named
# after this node, so that `stallwatch analyze $STALLWATCH_COLLECT_DIR/$SLURM_JOB_ID`
# sees every node of the job. Copies only: no analysis runs here.
# Settings: deploy/slurm/common.sh. Always exits 0 (a failed epilog drains the node).
set -uo pipefail
here=$(dirname "$(readlink -f "$0")")
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$here/common.sh"

# Waits up to $2 seconds for pid $1 to end.
wait_gone() {
    local tries=$(($2 * 10))
    while running "$1" && [ "$tries" -gt 0 ]; do
        tries=$((tries - 1))
        sleep 0.1
    done
    ! running "$1"
}

stop_agent() {
    local pid
    pid=$(agent_pid) || { rm -f "$pid_file"; return 0; }
    kill -TERM "$pid" 2>/dev/null
    if wait_gone "$pid" "$STALLWATCH_STOP_TIMEOUT"; then
        say epilog "agent pid $pid stopped"
    else
        say epilog "agent pid $pid still running after ${STALLWATCH_STOP_TIMEOUT}s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null
        # The kernel still detaches every probe as the process exits.
        wait_gone "$pid" "$STALLWATCH_STOP_TIMEOUT" || say epilog "agent pid $pid not gone after SIGKILL"
    fi
    rm -f "$pid_file"
}

# The job is over: its recording need not outlive the agent any more.
unpin() {
    [ -x "$STALLWATCH_BIN" ] || return 0
    "$STALLWATCH_BIN" record --cleanup --pin-dir "$pin_dir" >>"$log_file" 2>&1 \
        || say epilog "could not remove the pinned recording $pin_dir"
}

# Copy to a temporary name, then rename: readers of the shared folder never
# see half a dump.
copy_one() {
    local src=$1 dest=$2
    cp -p -- "$src" "$dest.part" && mv -f -- "$dest.part" "$dest"
}

collect() {
    [ -n "$STALLWATCH_COLLECT_DIR" ] || return 0
    [ -d "$dump_dir" ] || return 0
    local dest=$STALLWATCH_COLLECT_DIR/$job f n=0 failed=0
    mkdir -p "$dest" || { say epilog "cannot create $dest: dumps left in $dump_dir"; return 1; }
    for f in "$dump_dir"/*.msgpack; do
        [ -e "$f" ] || continue
        if copy_one "$f" "$dest/$node-$(basename "$f")"; then n=$((n + 1)); else failed=1; fi
    done
    [ -f "$log_file" ] && copy_one "$log_file" "$dest/$node-agent.log"
    if [ -n "${SLURM_JOB_UID:-}" ]; then
        chown -R "$SLURM_JOB_UID${SLURM_JOB_GID:+:$SLURM_JOB_GID}" "$dest" 2>/dev/null
    fi
    say epilog "collected $n dump(s) into $dest"
    return "$failed"
}

main() {
    stop_agent
    unpin
    # Local copies go only once the shared folder has every one of them.
    if collect && [ -n "$STALLWATCH_COLLECT_DIR" ]; then
        rm -rf -- "$dump_dir" "$log_file"
    fi
}

main
exit 0
