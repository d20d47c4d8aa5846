"""stallwatch: an always-on eBPF flight recorder for NCCL training jobs.

``__version__`` is the one home of the version: the distribution's metadata
(pyproject.toml) reads it from here, and so does every part that reports it.
"""

__version__ = "0.1.0"
