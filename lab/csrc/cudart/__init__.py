"""C sources of the lab's CUDA-runtime-compatible library, shipped as package
data and compiled by ``stallwatch.lab.build``."""
