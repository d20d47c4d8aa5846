"""The query and serving layer: the SQL engine and its sandbox (``sql``), the
HTTP surface that agents and ``stallwatch serve`` expose (``http``), and the
fan-out client that sends one query to many agents (``fanout``).

It stands on ``dumpers`` only, and serves the recorder and the analyzer alike:
the agent's live SQL and the SQL on dumps are the same engine.
"""
