"""Every error stallwatch raises on purpose derives from StallwatchError.

    StallwatchError
    +-- UsageError            bad argument or option (exit code 2)
    +-- DumpError             a dump or foreign recorder file cannot be used
    |   +-- DumpFormatError   not a dump, truncated, corrupt, or a field is wrong
    |   |   +-- DumpChecksumError  a section's bytes differ from what was written
    |   +-- DumpVersionError  a dump of a newer format version
    |   +-- DumpWriteError    a dump could not be written (disk full, permissions)
    +-- ProbeError            a BPF program failed to load or attach
    +-- PinError              a pinned recording cannot be made, adopted or removed
    +-- QueryError            an SQL query was refused or failed
    |   +-- QueryRefused      the query is not allowed (sandbox)
    |   +-- AnswerTooLarge    its answer would be over the request's limit
    |   +-- EngineBusy        the engine runs another query: ask again
    +-- AgentError            a live agent could not be reached or answered badly
    +-- LabError              the lab could not be set up or torn down

Messages say what was expected and what was found, and name the file, field
or argument.  The command line prints them in one line, without a traceback.

``ExitCode`` is the one meaning of a command's exit status, for every command.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """What every stallwatch command's exit status means."""

    OK = 0  # clean: nothing found, every input read, the job verified
    FINDINGS = 1  # findings (analyze), a partial result, a lab job that failed
    USAGE = 2  # bad input or usage, or nothing could be read


class StallwatchError(Exception):
    """Base of every error raised on purpose."""


class UsageError(StallwatchError):
    pass


class DumpError(StallwatchError):
    pass


class DumpFormatError(DumpError):
    pass


class DumpChecksumError(DumpFormatError):
    """A section of a dump (header, tables, a ring) whose checksum does not
    match what its writer recorded: damaged on disk or on the way."""


class DumpVersionError(DumpError):
    pass


class DumpWriteError(DumpError):
    pass


class ProbeError(StallwatchError):
    pass


class PinError(StallwatchError):
    pass


class QueryError(StallwatchError):
    pass


class QueryRefused(QueryError):
    pass


class AnswerTooLarge(QueryError):
    pass


class EngineBusy(QueryError):
    pass


class AgentError(StallwatchError):
    pass


class LabError(StallwatchError):
    pass
