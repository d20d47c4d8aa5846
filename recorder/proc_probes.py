"""The process probe family (bpf/proc.c), its uprobes: the exit code from
libc's ``_exit``, and discovery from the dynamic loader's
``_dl_debug_state`` (its cookie leads the program to the loader's list of
objects).  Its tracepoints (signals, exec, exit) are attached with every
other tracepoint of the module (``recorder.kernelhooks``).
"""

from __future__ import annotations

EXIT_PROGRAM = "handle_libc_exit"
EXIT_SYMBOL = "_exit"
LOADER_PROGRAM = "handle_dl_state"
LOADER_SYMBOL = "_dl_debug_state"
PROGRAMS = (EXIT_PROGRAM, LOADER_PROGRAM)
