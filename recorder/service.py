"""The agent's composition root: ``run_agent(config)`` loads the probes
(adopting a pinned recording), attaches, serves the HTTP surface, and loops
until SIGTERM/SIGINT (SIGUSR1 dumps now), then detaches or leaves the
recording pinned.  ``stallwatch record`` (``stallwatch.commands.record``)
builds the ``AgentConfig`` from its options and calls it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from stallwatch.dumpers.errors import ExitCode

if TYPE_CHECKING:
    from stallwatch.query.http import ServerHandle

    from .agent import Agent, AgentConfig
    from .loop import Stop
    from .pinning import PinOptions


def run_agent(config: AgentConfig) -> int:
    """Load, attach, serve, loop until SIGTERM/SIGINT, detach."""
    from stallwatch.query.credentials import remove_local_token

    from .agent import Agent
    from .loop import Stop, run_loop
    from .notify import Notifier
    from .source import BccSource

    log = logging.getLogger("stallwatch.record")
    # A wedged agent is stopped by its service manager's watchdog with SIGABRT:
    # every thread's Python stack goes to stderr (the journal), where it hung.
    faulthandler.enable(all_threads=True)
    source = BccSource(
        config.ring_size,
        int(config.runq_threshold_ms * 1e6),
        pins=_pin_options(config),
        about=_about(config),
        compile_outside=True,
        cache_dir=config.bpf_cache,
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
    log.info("link ring: %d slots, %.1f MiB", config.links.slots, agent.links.memory_bytes / 2**20)
    log.info(
        "network sample rings: %d and %d slots, %.1f MiB",
        config.netsamples.conn_slots,
        config.netsamples.iface_slots,
        agent.netsamples.memory_bytes / 2**20,
    )
    agent.serving(_port(config.listen))  # from the start: clients that wait for it too
    stop = Stop()
    server = token_file = None
    notifier = Notifier()
    try:
        for lib in config.libs:
            agent.attach_library(lib, required=True)
        for pid in config.pids:
            agent.attach_pid(pid)
        # before it says it listens: whoever waits for that line may stop it at once
        _install_signals(stop)
        server, token_file = _serve(agent, config)
        notifier.ready(f"recording, serving on {server.address}")
        run_loop(agent, stop, notifier)
    finally:
        notifier.stopping("stopping")
        if server is not None:
            server.close()
        remove_local_token(token_file)
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
        "job": config.job,
        "netns": netns_of(os.getpid()),
        "dump_dir": str(config.dump_dir.resolve()),
        "args": list(config.args),
    }


def _serve(agent: Agent, config: AgentConfig) -> tuple[ServerHandle, Path | None]:
    """The HTTP surface, and the file of its own dump credential, if it made
    one (an agent without a token: ``query.credentials``)."""
    from stallwatch.query import credentials
    from stallwatch.query.http import serve_http

    log = logging.getLogger("stallwatch.record")
    made = config.token is None and config.dump_token is None
    dump_token = credentials.new_token() if made else config.dump_token
    handle = serve_http(
        agent,
        config.listen,
        config.token,
        tls=config.tls,
        dump_token=dump_token,
        scrape_token=config.scrape_token,
    )
    log.info("listening on %s", handle.url)
    kept = None
    if made and dump_token is not None:
        host, port = handle.address.rsplit(":", 1)
        kept = credentials.write_local_token(host, int(port), dump_token)
        if kept is None:
            log.warning(
                "cannot write the dump credential to %s: dumps over HTTP need --token-file "
                "or --dump-token-file (SIGUSR1 dumps as ever)",
                credentials.RUN_DIR,
            )
    agent.serving(_port(handle.address))
    agent.serving_counters = handle.counters
    return handle, kept


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
