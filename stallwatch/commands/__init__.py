"""The command line: one module per subcommand (``main`` holds the root
parser), the option groups they share in ``options``.  The parts below
(recorder, analyzer, lab, query, dumpers) hold no argparse."""
