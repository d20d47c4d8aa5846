"""The eBPF C programs (one file per probe family) and ``events.h``, the
records they write (generated from ``dumpers/layout.py``: never edit it).
They ship as package data; the recorder loads them with BCC from wherever the
package is installed."""
