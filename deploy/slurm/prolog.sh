#!/usr/bin/env bash
# Slurm Prolog: start one stallwatch agent on this node for this job.
#
#   slurm.conf:  Prolog=/opt/stallwatch/deploy/slurm/prolog.sh
#                Epilog=/opt/stallwatch/deploy/slurm/epilog.sh
#                PrologFlags=Alloc     # run on every node at allocation
#
# The agent records into $STALLWATCH_STATE_DIR/$SLURM_JOB_ID, listens on
# $STALLWATCH_PORT and knows the job's other nodes as peers, so a stall seen on
# one node makes every node of the job dump the same window.
# Settings: deploy/slurm/common.sh. Always exits 0 (a failed prolog drains the node).
set -uo pipefail
here=$(dirname "$(readlink -f "$0")")
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$here/common.sh"
tls=$STALLWATCH_TLS_DIR
serving_tls=

# What is missing to listen beyond loopback (the token and TLS files), or nothing.
missing_for_network() {
    local f missing=()
    for f in "$STALLWATCH_TOKEN_FILE" "$tls/node.pem" "$tls/node.key" "$tls/ca.pem"; do
        [ -r "$f" ] || missing+=("$f")
    done
    echo "${missing[*]}"
}

agent_args() {
    args=(record --dump-dir "$dump_dir" --stall-timeout "$STALLWATCH_STALL_TIMEOUT")
    # kept when the agent stops: the epilog dumps from it and then removes it
    args+=(--pin-dir "$pin_dir" --keep-pinned)
    local missing
    missing=$(missing_for_network)
    if [ -z "$missing" ]; then
        args+=(--listen "0.0.0.0:$STALLWATCH_PORT" --token-file "$STALLWATCH_TOKEN_FILE")
        args+=(--tls-cert "$tls/node.pem" --tls-key "$tls/node.key" --tls-ca "$tls/ca.pem")
        [ "$STALLWATCH_TLS_MUTUAL" = 1 ] && args+=(--tls-client-ca "$tls/ca.pem")
        # The job's other nodes: the agent expands SLURM_JOB_NODELIST (its
        # environment is the prolog's) and leaves out SLURMD_NODENAME, itself.
        [ -n "${SLURM_JOB_NODELIST:-}" ] && args+=(--peers-from slurm)
        serving_tls=1
    else
        say prolog "no $missing: loopback only, no peers"
        args+=(--listen "127.0.0.1:$STALLWATCH_PORT")
    fi
    # shellcheck disable=SC2206  # word splitting is the point
    args+=($STALLWATCH_EXTRA_ARGS)
}

# /healthz over bash's /dev/tcp (no curl needed on compute nodes), with the
# token the agent then requires of every request.  An agent serving TLS
# answers plain HTTP with its own 400 ("HTTPS only"), sent by the running
# server: that answer is enough to know it is up (and the token is not sent).
healthy() {
    (
        exec 3<>"/dev/tcp/127.0.0.1/$STALLWATCH_PORT" || exit 1
        auth=
        [ -z "$serving_tls" ] && [ -r "$STALLWATCH_TOKEN_FILE" ] &&
            auth="Authorization: Bearer $(head -n1 "$STALLWATCH_TOKEN_FILE")"$'\r\n'
        printf 'GET /healthz HTTP/1.0\r\nHost: localhost\r\n%s\r\n' "$auth" >&3
        read -r -t 2 _ status _ <&3 || exit 1
        [ "$status" = 200 ] || { [ -n "$serving_tls" ] && [ "$status" = 400 ]; }
    ) 2>/dev/null
}

wait_ready() {
    local pid=$1 tries=$((STALLWATCH_READY_TIMEOUT * 5))
    while [ "$tries" -gt 0 ]; do
        tries=$((tries - 1))
        running "$pid" || { say prolog "agent exited at start, see $log_file"; return 1; }
        healthy && return 0
        sleep 0.2
    done
    [ "$STALLWATCH_READY_TIMEOUT" -eq 0 ] || say prolog "agent not healthy after ${STALLWATCH_READY_TIMEOUT}s"
}

main() {
    if pid=$(agent_pid); then
        say prolog "agent already running (pid $pid)"
        return 0
    fi
    [ -x "$STALLWATCH_BIN" ] || { say prolog "$STALLWATCH_BIN not executable: not recording"; return 0; }
    mkdir -p "$STALLWATCH_STATE_DIR" "$STALLWATCH_RUN_DIR" && install -d -m 0700 "$dump_dir" || return 0
    agent_args
    # Its own session, no terminal, no inherited descriptors: slurmd must not
    # wait on it, and the job's signals must not reach it.
    setsid "$STALLWATCH_BIN" "${args[@]}" </dev/null >>"$log_file" 2>&1 &
    echo $! >"$pid_file"
    say prolog "started agent pid $! (${args[*]})"
    wait_ready $!
}

main
exit 0
