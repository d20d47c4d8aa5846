"""C sources of the lab's NCCL-compatible library, shipped as package data and
compiled by ``stallwatch.lab.build``."""
