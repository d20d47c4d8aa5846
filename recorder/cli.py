"""``stallwatch record`` (the agent) and ``stallwatch dump`` (ask one to dump)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from stallwatch.dumpers.errors import AgentError, ExitCode, UsageError
from stallwatch.query import tls
from stallwatch.query.output import HelpFormatter, add_format_option

from .rings import check_ring_size

if TYPE_CHECKING:
    from stallwatch.query.http import ServerHandle

    from .agent import Agent, AgentConfig, Stop
    from .peers import PeerSource
    from .pinning import PinOptions

RECORD_EPILOG = """\
examples:
  stallwatch record --dump-dir /var/lib/stallwatch --stall-timeout 60
  stallwatch record --scope netns --peers node2:9400,node3:9400
  stallwatch record --listen 10.0.0.1:9400 --token-file /etc/stallwatch/token \\
      --tls-cert /etc/stallwatch/node.pem --tls-key /etc/stallwatch/node.key \\
      --tls-ca /etc/stallwatch/ca.pem --peers node2:9400,node3:9400
  stallwatch record ... --peers-from k8s-service stallwatch-peers.stallwatch.svc
  stallwatch record ... --peers-from slurm            the job's nodes (a Slurm prolog)
  stallwatch record ... --peers-from file /etc/stallwatch/peers
  stallwatch record --lib /opt/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2
  stallwatch record --keep-pinned --pin-dir /sys/fs/bpf/stallwatch/agent
                                       as a service (the systemd unit, DaemonSet, Slurm)
  kill -USR1 $(pidof stallwatch)       dump now
  stallwatch record --cleanup          remove the pinned recording (stop for good)

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

DUMP_EPILOG = """\
examples:
  stallwatch dump                                  the agent on this node
  stallwatch dump --agent node3:9400 --token-file /etc/stallwatch/token \\
      --tls-ca /etc/stallwatch/ca.pem --reason "loss spike at step 1200"
  stallwatch dump --pinned                         no agent running: dump what the
                                                   kernel recorded into the pins

exit codes: 0 the agent wrote (or is retrying) the dump; 2 the agent could not be
reached or refused, or nothing is pinned at --pin-dir.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _register_record(subparsers)
    _register_dump(subparsers)


def _register_record(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "record",
        help="run the always-on recorder (root)",
        description="Record every NCCL call of every process on this node, and the kernel "
        "events that explain a stall; dump the rings when a job stalls.",
        epilog=RECORD_EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--dump-dir", type=Path, default=Path("dumps"), metavar="DIR", help="where dumps go"
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        metavar="SEC",
        help="dump when a call or a communicator is stuck this long",
    )
    p.add_argument(
        "--lib",
        action="append",
        default=[],
        metavar="PATH",
        help="attach to this libnccl (or CUDA runtime, libcudart.so.N) too (repeatable)",
    )
    p.add_argument(
        "--pid",
        action="append",
        type=int,
        default=[],
        metavar="PID",
        help="record this process (its libnccl, or its executable if NCCL is linked in statically)",
    )
    p.add_argument(
        "--scope",
        choices=("host", "netns"),
        default="host",
        help="netns: only this network namespace's processes and addresses",
    )
    p.add_argument(
        "--ring-size",
        type=int,
        default=65536,
        metavar="N",
        help="slots of the NCCL ring (power of two); other rings are smaller",
    )
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
        "--token-file",
        type=Path,
        metavar="FILE",
        help="bearer token (required for a non-loopback --listen)",
    )
    tls.add_server_options(p)
    tls.add_client_options(p, what="the peers")
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
    _add_pin_dir(p)
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
    p.add_argument("--print-bpf", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=_record)


def _add_pin_dir(p: argparse.ArgumentParser) -> None:
    from .pinning import DEFAULT_PIN_DIR

    p.add_argument(
        "--pin-dir",
        type=Path,
        default=DEFAULT_PIN_DIR,
        metavar="DIR",
        help="the agent's folder on bpffs for its pinned recording (one per agent)",
    )


def _register_dump(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "dump",
        help="ask a running agent to dump its rings now",
        description="POST /dump to a running agent and print where it wrote the dump.",
        epilog=DUMP_EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--agent", default="127.0.0.1:9400", metavar="ADDR:PORT", help="the agent")
    p.add_argument(
        "--reason",
        default="requested by stallwatch dump",
        metavar="TEXT",
        help="why: kept in the dump's trigger",
    )
    p.add_argument("--token-file", type=Path, metavar="FILE", help="the agent's bearer token")
    tls.add_client_options(p, what="the agent")
    p.add_argument(
        "--pinned",
        action="store_true",
        help="no agent: write a dump from the pinned recording at --pin-dir (root)",
    )
    _add_pin_dir(p)
    p.add_argument(
        "--dump-dir",
        type=Path,
        metavar="DIR",
        help="with --pinned: where the dump goes (default: the agent's --dump-dir)",
    )
    add_format_option(p, ("json", "table"), default="json")
    p.set_defaults(func=_dump)


def _read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise UsageError(f"--token-file {path}: {exc.strerror or exc}") from None
    if not token:
        raise UsageError(f"--token-file {path}: the file is empty")
    return token


def _check_record_args(args: argparse.Namespace) -> None:
    check_ring_size(args.ring_size)
    if args.keep_pinned and args.no_pin:
        raise UsageError("--keep-pinned and --no-pin: a recording not pinned cannot be kept")
    if args.stall_timeout <= 0:
        raise UsageError(f"--stall-timeout: expected seconds > 0, got {args.stall_timeout}")
    if args.runq_threshold_ms < 0:
        raise UsageError(f"--runq-threshold-ms: expected >= 0, got {args.runq_threshold_ms}")
    for name in ("max_dumps", "max_dump_bytes"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise UsageError(f"--{name.replace('_', '-')}: expected >= 0, got {value}")
    for peer in filter(None, args.peers.split(",")):
        host, sep, port = peer.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UsageError(f"--peers: expected HOST:PORT,..., got {peer!r}")
    server = tls.server_from(args)
    if server is not None:
        server.context()  # a bad certificate or key is named before anything is compiled
    _peer_tls(args)
    _peers_from(args)  # a source that cannot work is named before anything is compiled


def _peers_from(args: argparse.Namespace) -> PeerSource | None:
    from .peers import peer_source, self_names

    if args.peers_from is None:
        return None
    return peer_source(args.peers_from, self_names(args.listen, args.host_name))


def _peer_tls(args: argparse.Namespace) -> tls.ClientTls | None:
    """Peers are reached over HTTPS when the agent serves HTTPS or is given
    a CA for them; the agent's own certificate is its client certificate."""
    if args.tls_ca is None and args.tls_cert is None:
        return None
    peer = tls.ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
    peer.context()
    return peer


def _setup_logging() -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s stallwatch record: %(levelname)s %(message)s",
    )


def _check_privileges() -> None:
    from .privileges import missing_for_recording, refusal

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


def _record(args: argparse.Namespace) -> int:
    if args.cleanup:
        return _cleanup(args.pin_dir)
    _check_record_args(args)
    if not args.print_bpf:
        _check_privileges()
        _check_paths(args)
    if args.print_bpf:
        from .probes import bpf_source

        print(bpf_source())
        return ExitCode.OK
    from stallwatch import __version__

    from .agent import AgentConfig

    config = AgentConfig(
        dump_dir=args.dump_dir,
        stall_timeout_s=args.stall_timeout,
        libs=tuple(args.lib),
        pids=tuple(args.pid),
        scope=args.scope,
        ring_size=args.ring_size,
        peers=tuple(filter(None, args.peers.split(","))),
        peers_from=_peers_from(args),
        listen=args.listen,
        token=_read_token(args.token_file),
        tls=tls.server_from(args),
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
    )
    try:
        config.dump_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--dump-dir {config.dump_dir}: {exc.strerror or exc}") from None
    _setup_logging()
    return run_agent(config)


def run_agent(config: AgentConfig) -> int:
    """Load, attach, serve, loop until SIGTERM/SIGINT, detach."""
    from .agent import Agent, Stop, run_loop
    from .notify import Notifier
    from .source import BccSource

    log = logging.getLogger("stallwatch.record")
    source = BccSource(
        config.ring_size,
        int(config.runq_threshold_ms * 1e6),
        pins=_pin_options(config),
        about=_about(config),
    )
    if source.pinset is not None:
        source.pinset.note_agent(os.getpid(), config.version, _about(config))
    sizes = source.sizes
    log.info(
        "rings: %s slots, %.1f MiB in total",
        ", ".join(f"{k}={v}" for k, v in sizes.as_dict().items()),
        sizes.memory_bytes() / 2**20,
    )
    agent = Agent(config, source)
    agent.serving(_port(config.listen))  # from the start: clients that wait for it too
    stop = Stop()
    server = None
    notifier = Notifier()
    try:
        for lib in config.libs:
            agent.attach_library(lib, required=True)
        for pid in config.pids:
            agent.attach_pid(pid)
        server = _serve(agent, config)
        _install_signals(stop)
        notifier.ready(f"recording, serving on {server.address}")
        run_loop(agent, stop, notifier)
    finally:
        notifier.stopping("stopping")
        if server is not None:
            server.close()
        _stop_recording(agent, config.keep_pinned)
    log.info("stopped")
    return ExitCode.OK


def _stop_recording(agent: Agent, keep_pinned: bool) -> None:
    """Detach; a foreground agent (no --keep-pinned) also unpins its
    recording, while it still holds the folder's lock, so that the kernel
    drops every probe and map once the agent's own fds close."""
    from .pinning import remove

    log = logging.getLogger("stallwatch.record")
    pins = agent.source.pinset
    if pins is None:
        log.info("stopping: detaching probes")
    elif keep_pinned:
        log.info(
            "stopping: the recording stays pinned at %s (the kernel goes on recording; "
            "stallwatch record --cleanup removes it)",
            pins.path,
        )
    else:
        log.info(
            "stopping: removing the pinned recording at %s and detaching probes "
            "(--keep-pinned keeps it)",
            pins.path,
        )
        remove(pins.path)
    agent.close()


def _pin_options(config: AgentConfig) -> PinOptions | None:
    from .pinning import PinOptions, check_pin_dir

    if config.pin_dir is None:
        return None
    check_pin_dir(config.pin_dir)
    return PinOptions(config.pin_dir, config.replace_pinned)


def _about(config: AgentConfig) -> dict[str, object]:
    """What a pin set says of the agent recording into it (for dump --pinned)."""
    from .discovery import netns_of

    return {
        "agent_version": config.version,
        "host_name": config.host_name or socket.gethostname(),
        "scope": config.scope,
        "netns": netns_of(os.getpid()),
        "dump_dir": str(config.dump_dir.resolve()),
        "args": list(config.args),
    }


def _cleanup(pin_dir: Path) -> int:
    from .pinning import cleanup

    if cleanup(pin_dir):
        print(f"removed the pinned recording at {pin_dir}")
    else:
        print(f"nothing pinned at {pin_dir}")
    return ExitCode.OK


def _serve(agent: Agent, config: AgentConfig) -> ServerHandle:
    from stallwatch.query.http import serve_http

    handle = serve_http(agent, config.listen, config.token, tls=config.tls)
    logging.getLogger("stallwatch.record").info("listening on %s", handle.url)
    agent.serving(_port(handle.address))
    agent.serving_counters = handle.counters
    return handle


def _port(address: str) -> int:
    """The port of ``host:port`` (0 if it has none)."""
    try:
        return int(address.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return 0


def _install_signals(stop: Stop) -> None:
    def on_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    def on_usr1(signum: int, frame: FrameType | None) -> None:
        stop.request_dump()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGUSR1, on_usr1)


def _dump(args: argparse.Namespace) -> int:
    if args.pinned:
        from .agent import dump_pinned

        answer = dump_pinned(args.pin_dir, args.dump_dir, args.reason, tuple(sys.argv[1:]))
        _print_answer(answer, args.format)
        return ExitCode.OK
    token = _read_token(args.token_file)
    client_tls = tls.client_from(args)
    context = client_tls.context() if client_tls is not None else None
    scheme = "https" if context is not None else "http"
    body = json.dumps({"reason": args.reason}).encode()
    req = urllib.request.Request(
        f"{scheme}://{args.agent}/dump",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as resp:
            answer = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace").strip()
        raise AgentError(f"agent {args.agent} refused the dump: {exc.code} {detail}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        why = tls.describe_failure(reason, args.tls_ca, args.tls_cert is not None)
        raise AgentError(f"agent {args.agent} unreachable: {why}") from None
    _print_answer(answer, args.format)
    return ExitCode.OK


def _print_answer(answer: dict[str, object], fmt: str) -> None:
    if fmt == "table":
        for key, value in sorted(answer.items()):
            print(f"{key:<14} {value}")
    else:
        print(json.dumps(answer, indent=2, sort_keys=True))
