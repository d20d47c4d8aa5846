"""What a lab run says: printed commands wrapped to fit a terminal that a
shell reads back as the same words, agent log lines told once each."""

from __future__ import annotations

import io
import subprocess
import time
from pathlib import Path

import pytest

from stallwatch.dumpers.sqltables import SEED_QUERY
from stallwatch.lab import narrate
from stallwatch.lab.narrate import Narrator, agent_line, wrapped
from stallwatch.lab.runner import LIVE_SQL


def words_bash_reads(text: str) -> list[str]:
    done = subprocess.run(
        ["bash", "--norc", "-c", f"printf '%s\\0' {text.split(maxsplit=1)[1]}"],
        capture_output=True,
        check=True,
    )
    return done.stdout.decode().split("\0")[:-1]


def test_a_wrapped_command_fits_and_reads_back_as_the_same_words() -> None:
    folder = "/run/stallwatch-lab/abcdef12/client"
    argv = ["/usr/local/bin/stallwatch", "query", "--agents-file", f"{folder}/agents.txt"]
    argv += ["--token-file", f"{folder}/token", "--tls-ca", f"{folder}/ca.pem", LIVE_SQL]
    text = wrapped(argv, width=96)
    assert all(len(line) <= 96 for line in text.splitlines()), text
    assert len(text.splitlines()) > 2
    got = words_bash_reads(text)  # the words after the program's
    assert got[:-1] == argv[1:-1]
    assert got[-1].split() == LIVE_SQL.split()  # SQL folded at blanks inside its quotes
    # an option keeps its value on its line
    assert any(line.strip().startswith("--token-file /run/") for line in text.splitlines())


def test_sql_with_characters_the_shell_expands_is_never_folded() -> None:
    sql = SEED_QUERY  # holds no double quote or $: folded; this one does
    tricky = "SELECT \"host\", count(*) FROM nccl_events WHERE op = '$x' " + "AND 1 = 1 " * 10
    for query in (sql, tricky):
        text = wrapped(["sw", "query", "d/", query], width=80)
        assert words_bash_reads(text)[-1].split() == query.split()


def test_agent_lines_are_told_once_with_what_they_mean(tmp_path: Path) -> None:
    log = tmp_path / "node1.agent.log"
    log.write_text(
        "2026-11-27 06:08:18,137 stallwatch record: INFO listening on https://10.201.4.2:9400\n"
        "2026-11-27 06:08:18,200 stallwatch record: INFO attached /lib/libnccl.so.2: 21 symbols\n"
        "2026-11-27 06:08:19,090 stallwatch record: WARNING incident lab-ab12-end (manual): "
        "end of lab run\n"
        "2026-11-27 06:08:19,100 stallwatch record: WARNING incident lab-ab12-end: "
        "dump written to /d/node1/x.msgpack\n"
        "2026-11-27 06:08:19,100 stallwatch record: INFO half a li"
    )
    out = io.StringIO()
    n = Narrator(out)
    n.agent_logs({"node1": log})
    n.agent_logs({"node1": log})  # nothing new
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines  # the dump is held until it stands
    assert lines[0].endswith("node1: agent up, listening on https://10.201.4.2:9400")
    assert lines[1].endswith("node1: a dump is asked for: end of lab run")  # not a stall
    n.agent_logs({"node1": log}, everything=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[2].endswith("node1: dump written: /d/node1/x.msgpack")
    assert n.listening == {"node1"} and n.dumped == {"node1"}
    assert agent_line("INFO attached /lib/libnccl.so.2") is None


OWN, PEERS = "20261127T064128271-node2-960823", "20261127T064128264-node1-9b413d"


def _agent_log(path: Path, *lines: str) -> None:
    with path.open("a") as f:
        for line in lines:
            f.write(f"2026-11-27 06:41:28,300 stallwatch record: WARNING {line}\n")


def test_a_dump_folded_into_a_peers_incident_is_told_as_the_file_it_became(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's own dump, rewritten under the incident a peer detected
    first (as the agents log it), is never told as written: the file it
    became is, with what was folded into what."""
    log = tmp_path / "node2.agent.log"
    _agent_log(
        log,
        f"incident {OWN} (in_flight): ALL_REDUCE seq 12 in flight for 5.0 s",
        f"incident {OWN}: dump written to /d/node2/node2-{OWN}-a.msgpack",
        f"incident {OWN} is node1's {PEERS}: relabelling",
        f"incident {PEERS}: dump written to /d/node2/node2-{PEERS}-b.msgpack",
    )
    out = io.StringIO()
    n = Narrator(out)
    n.agent_logs({"node2": log})
    later = time.monotonic() + narrate.HOLD_S
    monkeypatch.setattr(narrate.time, "monotonic", lambda: later)
    n.agent_logs({"node2": log})  # held long enough: it stands
    said = out.getvalue()
    assert f"node2-{OWN}-a.msgpack" not in said, said
    assert said.splitlines()[-1].endswith(
        f"node2: dump written: /d/node2/node2-{PEERS}-b.msgpack "
        f"(its own incident {OWN} folded into node1's {PEERS})"
    ), said


def test_a_dump_folded_twice_names_the_agents_own_incident(tmp_path: Path) -> None:
    """Three agents detect one stall at once: this one folds its own dump
    into a peer's incident, then into an earlier one's; told once, as the
    file it became, folded from its own."""
    log = tmp_path / "node0.agent.log"
    first = "20261127T064128250-node2-aaaaaa"
    _agent_log(
        log,
        f"incident {OWN}: dump written to /d/node0/a.msgpack",
        f"incident {OWN} is node1's {PEERS}: relabelling",
        f"incident {PEERS}: dump written to /d/node0/b.msgpack",
        f"incident {PEERS} is node2's {first}: relabelling",
        f"incident {first}: dump written to /d/node0/c.msgpack",
    )
    out = io.StringIO()
    Narrator(out).agent_logs({"node0": log}, everything=True)
    (line,) = out.getvalue().splitlines()
    assert line.endswith(
        f"node0: dump written: /d/node0/c.msgpack (its own incident {OWN} folded into "
        f"node2's {first})"
    ), line


def test_a_dump_rewritten_after_it_was_told_is_said_to_be(tmp_path: Path) -> None:
    log = tmp_path / "node2.agent.log"
    _agent_log(log, f"incident {OWN}: dump written to /d/node2/a.msgpack")
    out = io.StringIO()
    n = Narrator(out)
    n.agent_logs({"node2": log}, everything=True)
    _agent_log(
        log,
        f"incident {OWN} is a peer's {PEERS}: relabelling",
        f"incident {PEERS}: dump written to /d/node2/b.msgpack",
    )
    n.agent_logs({"node2": log}, everything=True)
    lines = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert lines == [
        "node2: dump written: /d/node2/a.msgpack",
        f"node2: its incident {OWN} is a peer's {PEERS}: /d/node2/a.msgpack is rewritten "
        "under that id",
        f"node2: dump written: /d/node2/b.msgpack (its own incident {OWN} folded into a "
        f"peer's {PEERS})",
    ]
