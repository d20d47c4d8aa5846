"""stallwatch: an always-on eBPF flight recorder for NCCL training jobs."""

__version__ = "0.1.0"
