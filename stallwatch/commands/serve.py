"""``stallwatch serve``: dumps served over HTTP like a live agent."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from stallwatch.dumpers.errors import ExitCode, UsageError
from stallwatch.dumpers.inputs import input_notes
from stallwatch.query.output import note

from .options import HelpFormatter, add_server_tls, add_token_option, read_token, server_tls_from
from .query import read_recordings

DEFAULT_LISTEN = "127.0.0.1:9400"

SERVE_EPILOG = """\
examples:
  stallwatch serve dumps/incident-42/          # on 127.0.0.1:9400
  stallwatch serve dumps/*.msgpack --listen 0.0.0.0:9400 --token-file token.txt \\
      --tls-cert node.pem --tls-key node.key
  stallwatch query --agents 127.0.0.1:9400 "SELECT count(*) FROM nccl_events"

Serves POST /query, POST /fetch, GET /metrics and GET /healthz like a live
agent (POST /dump answers 501). A non-loopback --listen needs TLS (--tls-cert,
--tls-key) and --token-file.

exit codes: 0 stopped (Ctrl-C, SIGTERM); 2 bad usage, a port it cannot listen
on, or no dump could be read.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = subparsers.add_parser(
        "serve",
        help="serve dumps over HTTP like a live agent",
        description="Serve recorded dumps through the agent's HTTP surface, to share an "
        "incident or to query many recordings with `stallwatch query --agents`.",
        epilog=SERVE_EPILOG,
        formatter_class=HelpFormatter,
    )
    s.add_argument("paths", nargs="+", metavar="DUMP", help="dump files or folders")
    s.add_argument(
        "--listen", default=DEFAULT_LISTEN, metavar="ADDR:PORT", help="address to serve on"
    )
    add_token_option(s, "require this bearer token")
    add_server_tls(s)
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stallwatch.query.http import RecordingsBackend, serve_http

    token = read_token(args.token_file)
    server_tls = server_tls_from(args)
    recordings, statuses = read_recordings(args.paths)
    for line in input_notes(statuses):
        note("serve", line)
    if not recordings:
        raise UsageError("no readable dump among the inputs")
    backend = RecordingsBackend(recordings)
    handle = serve_http(backend, args.listen, token, tls=server_tls)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(
        f"stallwatch serve: {len(recordings)} dump(s) of {backend.host} on "
        f"{handle.url} (Ctrl-C to stop)",
        file=sys.stderr,
        flush=True,
    )
    print(f"listening on {handle.address}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        handle.close()
    return ExitCode.OK
