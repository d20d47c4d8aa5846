"""The eBPF C programs (one file per probe family) and ``events.h``, the
records they write.  They ship as package data; the recorder loads them with
BCC from wherever the package is installed."""
