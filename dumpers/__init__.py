"""The dump format and the table layout every other part of stallwatch uses.

``dumpers`` is the base of the import graph: it imports none of the other
packages.
"""
