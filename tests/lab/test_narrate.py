"""What a lab run says: printed commands wrapped to fit a terminal that a
shell reads back as the same words, agent log lines told once each."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

from stallwatch.dumpers.sqltables import SEED_QUERY
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
        "2026-11-27 06:08:19,100 stallwatch record: INFO dump written to /d/node1/x.msgpack\n"
        "2026-11-27 06:08:19,100 stallwatch record: INFO half a li"
    )
    out = io.StringIO()
    n = Narrator(out)
    n.agent_logs({"node1": log})
    n.agent_logs({"node1": log})  # nothing new
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("node1: agent up, listening on https://10.201.4.2:9400")
    assert lines[1].endswith("node1: dump written: /d/node1/x.msgpack")
    assert n.listening == {"node1"} and n.dumped == {"node1"}
    assert agent_line("INFO attached /lib/libnccl.so.2") is None
