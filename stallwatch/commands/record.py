"""``stallwatch record``: the always-on agent (its composition root is
``recorder.service.run_agent``; this module turns options into its config)."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from stallwatch.dumpers.errors import ExitCode, UsageError
from stallwatch.query.tls import ClientTls, ServerTls
from stallwatch.recorder.rings import check_ring_size
from stallwatch.recorder.stallbound import DEFAULT_CEILING_S, DEFAULT_FLOOR_S

from .options import (
    HelpFormatter,
    add_client_tls,
    add_pin_dir,
    add_process_options,
    add_server_tls,
    add_token_option,
    read_token,
    server_tls_from,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from stallwatch.recorder.agent import AgentConfig
    from stallwatch.recorder.peers import PeerSource
    from stallwatch.recorder.slowdown import SlowdownConfig
    from stallwatch.recorder.verdicts import Judge

EPILOG = """\
examples:
  stallwatch record --dump-dir /var/lib/stallwatch --stall-timeout 60
  stallwatch record --scope netns --peers node2:9400,node3:9400
  stallwatch record --listen 10.0.0.1:9400 --token-file /etc/stallwatch/token \\
      --tls-cert /etc/stallwatch/node.pem --tls-key /etc/stallwatch/node.key \\
      --tls-ca /etc/stallwatch/ca.pem --peers node2:9400,node3:9400
  stallwatch record --peers-from k8s-service stallwatch-peers.stallwatch.svc
  stallwatch record --peers-from slurm     # the job's nodes (a Slurm prolog)
  stallwatch record --peers-from file /etc/stallwatch/peers
  stallwatch record --lib /opt/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2
  # as a service (the systemd unit, DaemonSet, Slurm):
  stallwatch record --keep-pinned --pin-dir /sys/fs/bpf/stallwatch/agent
  kill -USR1 "$(pidof stallwatch)"         # dump now
  stallwatch record --cleanup              # remove the pinned recording (stop for good)
  # compile once at install: a start with nothing pinned then loads the programs
  stallwatch record --compile-only

the recording is pinned under --pin-dir (one folder per agent). Started by
hand, the agent is a foreground tool: stopped with Ctrl-C or SIGTERM it
removes its probes and pins, and nothing records after it. With
--keep-pinned (what the deployment files pass) rings, tables, counters and
probes stay in the kernel when the agent stops, the kernel goes on recording,
and the next agent started with the same --pin-dir takes them over;
stallwatch dump --pinned writes a dump from them with no agent. An agent that
dies without stopping (SIGKILL, the OOM killer) leaves its pins either way.

exit codes: 0 stopped cleanly; 2 bad usage, missing privileges or paths, or a
pinned recording it cannot adopt (checked before anything is attached).
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "record",
        help="run the always-on recorder (root)",
        description="Record every NCCL call of every process on this node, and the kernel "
        "events that explain a stall; dump the rings when a job stalls.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    # In this order in --help: what is recorded, the network, limits, pins.
    _add_recording_options(p)
    _add_slowdown_options(p)
    _add_network_options(p)
    _add_limit_options(p)
    _add_pin_options(p)
    p.set_defaults(func=run)


def _add_recording_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dump-dir", type=Path, default=Path("dumps"), metavar="DIR", help="where dumps go"
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=DEFAULT_CEILING_S,
        metavar="SEC",
        help="the ceiling: dump when a communicator made no progress this long, or a call "
        "stood still this long whatever its communicator's own bound",
    )
    p.add_argument(
        "--stall-floor",
        type=float,
        default=DEFAULT_FLOOR_S,
        metavar="SEC",
        help="a call in flight is a stall once its communicator made no progress for the "
        "larger of this and a multiple of its recent durations (raised by its warm-up and by "
        "pauses it survived; --stall-timeout at most)",
    )
    p.add_argument(
        "--lib",
        action="append",
        default=[],
        metavar="PATH",
        help="attach to this libnccl (or CUDA runtime, libcudart.so.N) too (repeatable)",
    )
    add_process_options(
        p,
        pid_help="record this process (its libnccl, or its executable if NCCL is linked in "
        "statically)",
        scope_help="netns: only this network namespace's processes and addresses",
    )
    p.add_argument(
        "--job",
        default=None,
        metavar="ID",
        help="only the processes of this job (TORCHELASTIC_RUN_ID or SLURM_JOB_ID in their "
        "environment): a node that several jobs share",
    )
    p.add_argument(
        "--ring-size",
        type=int,
        default=65536,
        metavar="N",
        help="slots of the NCCL ring (power of two); other rings are smaller",
    )


def _add_slowdown_options(p: argparse.ArgumentParser) -> None:
    from stallwatch.recorder import slowdown as sd

    g = p.add_argument_group(
        "slowdown trigger",
        "dump when a job goes on, only slower (docs/agent.md: how the defaults were measured)",
    )
    g.add_argument(
        "--slowdown-factor",
        type=float,
        default=sd.DEFAULT_FACTOR,
        metavar="X",
        help="a communicator calling X times slower than its baseline is a slowdown "
        "(0: no slowdown trigger; the metrics stay)",
    )
    g.add_argument(
        "--slowdown-window",
        type=float,
        default=sd.DEFAULT_WINDOW_S,
        metavar="SEC",
        help="for this long, every tick, before it is an incident",
    )
    g.add_argument(
        "--slowdown-baseline",
        type=float,
        default=sd.DEFAULT_BASELINE_S,
        metavar="SEC",
        help="how much of the past a communicator's baseline is the median of",
    )
    g.add_argument(
        "--slowdown-late-share",
        type=float,
        default=sd.DEFAULT_LATE_SHARE,
        metavar="S",
        help="a rank of this node last to enter nearly every collective, S of the "
        "communicator's baseline interval later than it used to be, is a slowdown (0: never)",
    )
    g.add_argument(
        "--slowdown-device-late-share",
        type=float,
        default=sd.DEFAULT_DEVICE_LATE_SHARE,
        metavar="S",
        help="the same, for calls timed on the device (CUDA): a rank whose device starts "
        "nearly every collective last, S of the baseline interval later than it used to "
        "(0: never)",
    )
    g.add_argument(
        "--slowdown-hold",
        type=float,
        default=sd.DEFAULT_HOLD_S,
        metavar="SEC",
        help="a collective held this long (and 10x its baseline) with the network failing "
        "inside it (connections unacknowledged, a carrier lost) is a slowdown (0: never)",
    )
    g.add_argument(
        "--slowdown-hold-wait",
        type=float,
        default=sd.DEFAULT_HELD_WAIT_S,
        metavar="SEC",
        help="a held collective's incident is raised this long after it returned, so that "
        "the dumps hold what followed it too",
    )


def _slowdown_config(args: argparse.Namespace) -> SlowdownConfig:
    from stallwatch.recorder.slowdown import MIN_BASELINE_S, SlowdownConfig

    factor, window, base = args.slowdown_factor, args.slowdown_window, args.slowdown_baseline
    if factor != 0 and factor <= 1:
        raise UsageError(f"--slowdown-factor: expected 0 (off) or more than 1, got {factor:g}")
    if window <= 0:
        raise UsageError(f"--slowdown-window: expected seconds > 0, got {window:g}")
    if base < MIN_BASELINE_S:
        raise UsageError(
            f"--slowdown-baseline: expected {MIN_BASELINE_S:g} seconds or more, got {base:g}"
        )
    for name in (
        "slowdown_late_share",
        "slowdown_device_late_share",
        "slowdown_hold",
        "slowdown_hold_wait",
    ):
        value = getattr(args, name)
        if value < 0:
            raise UsageError(f"--{name.replace('_', '-')}: expected >= 0, got {value:g}")
    return SlowdownConfig(
        factor,
        window,
        base,
        args.slowdown_late_share,
        args.slowdown_hold,
        args.slowdown_hold_wait,
        args.slowdown_device_late_share,
    )


def _add_network_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peers",
        default="",
        metavar="HOST:PORT,...",
        help="agents to ask for a dump of the same incident",
    )
    p.add_argument(
        "--peers-from",
        nargs="+",
        metavar=("KIND", "ARG"),
        help="peers found at each incident: 'k8s-service NAME[:PORT]' (a headless Service's "
        "addresses), 'slurm' (the job's nodes, SLURM_JOB_NODELIST), 'file PATH' (one HOST[:PORT] "
        "a line, read again when it changes); the port defaults to --listen's",
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1:9400",
        metavar="ADDR:PORT",
        help="HTTP surface: /query /dump /metrics /healthz",
    )
    p.add_argument(
        "--probe-port",
        type=int,
        default=9401,
        metavar="PORT",
        help="at a stall or slowdown, probe the paths to the nodes the job's connections go "
        "to (UDP sizes up to the MTU, ICMP echo, a TCP exchange: 2 s, at most 1 MB a peer), "
        "and answer the peers' probes on this port of every address (UDP and TCP; the same "
        "on every node; 0: neither)",
    )
    add_token_option(p, "bearer token (required for a non-loopback --listen)")
    p.add_argument(
        "--dump-token-file",
        type=Path,
        metavar="FILE",
        help="a second token that opens POST /dump (and /healthz) only, for whoever may ask "
        "for dumps and nothing else; an agent with neither token makes one at start, in "
        "/run/stallwatch, where stallwatch dump on this node finds it",
    )
    p.add_argument(
        "--scrape-token-file",
        type=Path,
        metavar="FILE",
        help="a read-only token that opens GET /metrics (and /healthz) only: Prometheus's",
    )
    add_server_tls(p)
    add_client_tls(p, what="the peers")
    p.add_argument(
        "--notify",
        metavar="URL",
        help="post each verdict of an incident this agent detects to this webhook "
        "(Alertmanager's webhook JSON, with a 'text' line chat webhooks show), retried",
    )
    p.add_argument(
        "--no-verdict",
        action="store_true",
        help="do not gather and publish the verdict of the incidents this agent detects "
        "(<incident>.verdict.json beside the dumps, the log, /metrics, --notify)",
    )


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-dumps", type=int, metavar="N", help="keep at most N dumps")
    p.add_argument("--max-dump-bytes", type=int, metavar="N", help="keep at most N bytes of dumps")
    p.add_argument(
        "--runq-threshold-ms",
        type=float,
        default=1.0,
        metavar="MS",
        help="record run-queue waits of rank threads longer than this",
    )
    p.add_argument(
        "--keep-own-traffic",
        action="store_true",
        help="record the agent's own connections (its HTTP surface, its requests to peers) "
        "in tcp_events too",
    )
    p.add_argument("--host-name", default="", help="host name in dumps (default: the hostname)")


def _add_pin_options(p: argparse.ArgumentParser) -> None:
    add_pin_dir(p)
    p.add_argument(
        "--keep-pinned",
        action="store_true",
        help="on SIGTERM/Ctrl-C leave the recording pinned (probes stay, the kernel records "
        "on, the next agent takes it over): what a service does; by default a stopped agent "
        "removes its pins",
    )
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="record without pinning: the recording ends with the agent",
    )
    p.add_argument(
        "--replace-pinned",
        action="store_true",
        help="replace a pinned recording of another layout (its rows are lost)",
    )
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="remove the pinned recording at --pin-dir (probes, rings) and exit",
    )
    p.add_argument(
        "--bpf-cache",
        type=Path,
        default=Path("/var/cache/stallwatch"),
        metavar="DIR",
        help="where compiled BPF programs are kept, so that a start with nothing pinned "
        "compiles nothing (one file per build; unwritable: compiled at each cold start)",
    )
    p.add_argument(
        "--no-bpf-cache", action="store_true", help="compile at every start with nothing pinned"
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the BPF programs for this kernel into --bpf-cache and exit, attaching "
        "nothing (at install, or at boot after a kernel upgrade: the agent's first start "
        "then loads them instead of compiling); give it the agent's --ring-size and "
        "--runq-threshold-ms",
    )
    p.add_argument("--print-bpf", action="store_true", help=argparse.SUPPRESS)


def _check_args(args: argparse.Namespace) -> None:
    check_ring_size(args.ring_size)
    if args.compile_only and args.no_bpf_cache:
        raise UsageError("--compile-only and --no-bpf-cache: compiling only fills the cache")
    if args.keep_pinned and args.no_pin:
        raise UsageError("--keep-pinned and --no-pin: a recording not pinned cannot be kept")
    if args.stall_timeout <= 0:
        raise UsageError(f"--stall-timeout: expected seconds > 0, got {args.stall_timeout}")
    if args.stall_floor <= 0:
        raise UsageError(f"--stall-floor: expected seconds > 0, got {args.stall_floor}")
    if not 0 <= args.probe_port < 65536:
        raise UsageError(f"--probe-port: expected 0 (none) to 65535, got {args.probe_port}")
    if args.runq_threshold_ms < 0:
        raise UsageError(f"--runq-threshold-ms: expected >= 0, got {args.runq_threshold_ms}")
    _slowdown_config(args)
    for name in ("max_dumps", "max_dump_bytes"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise UsageError(f"--{name.replace('_', '-')}: expected >= 0, got {value}")
    for peer in filter(None, args.peers.split(",")):
        host, sep, port = peer.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UsageError(f"--peers: expected HOST:PORT,..., got {peer!r}")
    server = server_tls_from(args)
    if server is not None:
        server.context()  # a bad certificate or key is named before anything is compiled
    _peer_tls(args)
    _peers_from(args)  # a source that cannot work is named before anything is compiled
    if args.notify is not None:
        if args.no_verdict:
            raise UsageError("--notify and --no-verdict: the notice is the verdict")
        from stallwatch.query.agentclient import split_url

        try:
            split_url(args.notify)
        except UsageError as exc:
            raise UsageError(f"--notify: {exc}") from None


def _check_listen(args: argparse.Namespace, server: ServerTls | None) -> None:
    """--listen, its TLS and token, and that it is free: named before
    anything is compiled or attached."""
    from stallwatch.query.http import check_listen, try_listen

    check_listen(args.listen, read_token(args.token_file), server)
    for option in ("dump_token_file", "scrape_token_file"):
        read_token(getattr(args, option), f"--{option.replace('_', '-')}")
    try_listen(args.listen)


def _peers_from(args: argparse.Namespace) -> PeerSource | None:
    from stallwatch.recorder.peers import peer_source, self_names

    if args.peers_from is None:
        return None
    return peer_source(args.peers_from, self_names(args.listen, args.host_name))


def _peer_tls(args: argparse.Namespace) -> ClientTls | None:
    """Peers are reached over HTTPS when the agent serves HTTPS or is given
    a CA for them; the agent's own certificate is its client certificate."""
    if args.tls_ca is None and args.tls_cert is None:
        return None
    peer = ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
    peer.context()
    return peer


def _setup_logging() -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s stallwatch record: %(levelname)s %(message)s",
    )


def _check_privileges() -> None:
    from stallwatch.recorder.privileges import missing_for_recording, refusal

    missing = missing_for_recording()
    if missing:
        raise UsageError(refusal(missing))


def _check_paths(args: argparse.Namespace) -> None:
    for lib in args.lib:
        if not Path(lib).is_file():
            raise UsageError(f"--lib {lib}: no such file")
    for pid in args.pid:
        if not Path(f"/proc/{pid}").is_dir():
            raise UsageError(f"--pid {pid}: no such process")


def run(args: argparse.Namespace) -> int:
    if args.cleanup:
        return _cleanup(args.pin_dir)
    _check_args(args)
    if args.print_bpf:
        from stallwatch.recorder.bpfbuild import bpf_source

        print(bpf_source())
        return ExitCode.OK
    _check_privileges()
    if args.compile_only:
        return _compile_only(args)
    _check_paths(args)
    _check_listen(args, server_tls_from(args))
    config = _config(args)
    try:
        config.dump_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--dump-dir {config.dump_dir}: {exc.strerror or exc}") from None
    _setup_logging()
    from stallwatch.recorder.service import run_agent

    return run_agent(config)


def _config(args: argparse.Namespace) -> AgentConfig:
    from stallwatch import __version__
    from stallwatch.recorder.agent import AgentConfig
    from stallwatch.recorder.pathprobe import ProbeConfig

    return AgentConfig(
        dump_dir=args.dump_dir,
        stall_timeout_s=args.stall_timeout,
        stall_floor_s=args.stall_floor,
        libs=tuple(args.lib),
        pids=tuple(args.pid),
        scope=args.scope,
        job=args.job or None,
        ring_size=args.ring_size,
        peers=tuple(filter(None, args.peers.split(","))),
        peers_from=_peers_from(args),
        listen=args.listen,
        token=read_token(args.token_file),
        dump_token=read_token(args.dump_token_file, "--dump-token-file"),
        scrape_token=read_token(args.scrape_token_file, "--scrape-token-file"),
        tls=server_tls_from(args),
        peer_tls=_peer_tls(args),
        max_dumps=args.max_dumps,
        max_dump_bytes=args.max_dump_bytes,
        runq_threshold_ms=args.runq_threshold_ms,
        keep_own_traffic=args.keep_own_traffic,
        host_name=args.host_name,
        args=tuple(sys.argv[1:]),
        version=__version__,
        pin_dir=None if args.no_pin else args.pin_dir,
        replace_pinned=args.replace_pinned,
        keep_pinned=args.keep_pinned,
        bpf_cache=None if args.no_bpf_cache else args.bpf_cache,
        slowdown=_slowdown_config(args),
        judge=None if args.no_verdict else _judge(args),
        notify_url=args.notify,
        probes=ProbeConfig(port=args.probe_port),
    )


def _judge(args: argparse.Namespace) -> Judge:
    """The verdict of an incident, as ``stallwatch analyze --agents ...
    --incident ID --json`` run as a child of the agent: the agent carries no
    analysis (its memory bound and its loop are the recording's), and the
    verdict is the live verdict's, on the dumps as written.  The token goes
    through the child's standard input, never its command line."""
    from stallwatch.recorder.verdicts import ChildJudge

    peer = _peer_tls(args)

    def argv(incident: str, agents: Sequence[str]) -> list[str]:
        out = [sys.executable, "-m", "stallwatch", "analyze", "--json", "--request-stdin"]
        out += ["--agents", ",".join(agents), "--incident", incident]
        return out + (_tls_args(peer) if peer is not None else [])

    return ChildJudge(argv, read_token(args.token_file))


def _tls_args(tls: ClientTls) -> list[str]:
    out = []
    for flag, path in (("--tls-ca", tls.ca), ("--tls-cert", tls.cert), ("--tls-key", tls.key)):
        if path is not None:
            out += [flag, str(Path(path).resolve())]
    return out


def _compile_only(args: argparse.Namespace) -> int:
    from stallwatch.recorder.bpfbuild import RingSizes
    from stallwatch.recorder.probes import compile_into

    cache = args.bpf_cache
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.TemporaryFile(dir=cache):  # writable: named before compiling
            pass
    except OSError as exc:
        raise UsageError(f"--bpf-cache {cache}: {exc.strerror or exc}") from None
    _setup_logging()
    sizes = RingSizes.from_nccl(args.ring_size)
    path, now = compile_into(cache, sizes, int(args.runq_threshold_ms * 1e6))
    if now:
        print(f"compiled the BPF programs for this kernel into {path}")
    else:
        print(f"already compiled for this kernel: {path} (nothing compiled)")
    return ExitCode.OK


def _cleanup(pin_dir: Path) -> int:
    from stallwatch.recorder.pinning import cleanup

    if cleanup(pin_dir):
        print(f"removed the pinned recording at {pin_dir}")
    else:
        print(f"nothing pinned at {pin_dir}")
    return ExitCode.OK
