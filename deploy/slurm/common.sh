# shellcheck shell=bash
# Shared by prolog.sh and epilog.sh: settings and helpers. Sourced, not run.
#
# Every setting can be overridden in /etc/default/stallwatch-slurm (or the file
# named by STALLWATCH_CONF), or in slurmd's environment.
#
# A failing prolog or epilog drains the node in Slurm. stallwatch is an
# observer: whatever goes wrong here is logged and the scripts exit 0.

# shellcheck disable=SC1090
conf=${STALLWATCH_CONF:-/etc/default/stallwatch-slurm}
[ -r "$conf" ] && . "$conf"

STALLWATCH_BIN=${STALLWATCH_BIN:-/opt/stallwatch/.venv/bin/stallwatch}
# Per-job dump folders live under STATE_DIR/$SLURM_JOB_ID; the agent's log beside.
STALLWATCH_STATE_DIR=${STALLWATCH_STATE_DIR:-/var/lib/stallwatch}
STALLWATCH_RUN_DIR=${STALLWATCH_RUN_DIR:-/run/stallwatch}
STALLWATCH_PORT=${STALLWATCH_PORT:-9400}
STALLWATCH_STALL_TIMEOUT=${STALLWATCH_STALL_TIMEOUT:-60}
# Same file, same contents, on every node. Without it (or without the TLS
# files below) the agent listens on loopback only and has no peers: each node
# still dumps on its own stalls.
STALLWATCH_TOKEN_FILE=${STALLWATCH_TOKEN_FILE:-/etc/stallwatch/token}
# TLS, needed to listen beyond loopback (the token must not cross the network
# in clear text): node.pem (this node's certificate, its host name among the
# subject alternative names), node.key, and ca.pem (the CA that signed every
# node's certificate; peers are verified against it).
STALLWATCH_TLS_DIR=${STALLWATCH_TLS_DIR:-/etc/stallwatch/tls}
# Set to 1 to also require a client certificate of that CA (mutual TLS).
STALLWATCH_TLS_MUTUAL=${STALLWATCH_TLS_MUTUAL:-0}
# Extra `stallwatch record` arguments, for example "--lib /opt/nccl/lib/libnccl.so.2".
STALLWATCH_EXTRA_ARGS=${STALLWATCH_EXTRA_ARGS:-}
# Seconds the prolog waits for the agent's /healthz (so the job's first
# ncclCommInitRank is recorded); 0 to not wait.
STALLWATCH_READY_TIMEOUT=${STALLWATCH_READY_TIMEOUT:-20}
# Seconds the epilog waits after SIGTERM before SIGKILL, and again after it:
# on kernels before 6.6 detaching uprobes takes seconds per library (see the
# systemd unit).
STALLWATCH_STOP_TIMEOUT=${STALLWATCH_STOP_TIMEOUT:-60}
# Shared folder (all nodes) for the job's dumps; empty to leave them on the node.
STALLWATCH_COLLECT_DIR=${STALLWATCH_COLLECT_DIR:-}
# The agent pins its recording in a per-job folder here (bpffs): a crashed
# agent loses nothing; the epilog removes it with the job.
STALLWATCH_PIN_ROOT=${STALLWATCH_PIN_ROOT:-/sys/fs/bpf/stallwatch}

job=${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run me as the Slurm Prolog or Epilog}
# It names files and folders: digits only, as Slurm's job ids are.
if ! [[ "$job" =~ ^[0-9]+$ ]]; then
    echo "stallwatch-slurm: SLURM_JOB_ID=$job is not a job id: nothing done" >&2
    exit 0
fi
# shellcheck disable=SC2034  # used by prolog.sh and epilog.sh
node=${SLURMD_NODENAME:-$(hostname -s)}
dump_dir=$STALLWATCH_STATE_DIR/$job
# shellcheck disable=SC2034  # used by prolog.sh and epilog.sh
pin_dir=$STALLWATCH_PIN_ROOT/slurm-$job
pid_file=$STALLWATCH_RUN_DIR/$job.pid
log_file=$STALLWATCH_STATE_DIR/$job.log

# To slurmd's stderr and to the agent's log (which the epilog collects).
say() {
    local msg
    msg=$(printf '%s stallwatch-slurm[%s] job %s: %s' "$(date -u +%FT%TZ)" "$1" "$job" "$2")
    echo "$msg" >&2
    echo "$msg" 2>/dev/null >>"$log_file"
}

# The pid in pid_file, if it is still this job's agent (pids are reused).
agent_pid() {
    local pid
    pid=$(cat "$pid_file" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "record --dump-dir $dump_dir " || return 1
    echo "$pid"
}

# Still running: a zombie (exited, waiting to be reaped) is not.
running() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    [ "$(echo "${stat##*) }" | cut -d' ' -f1)" != Z ]
}
