"""The `exo` command's entry point (`exo`, `python -m exo`).

Kept free of the node's imports (torch, transformers, the API), which take ~6 s on a
2-core machine: `exo --help`, `exo --version`, a bad flag and `exo bench ...` answer
without them; the node is imported only once its flags are parsed.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Run `exo bench ...` (`exo.benchmark.cli`) or parse the node's flags and run a node
    until it is stopped.

    Raises:
        SystemExit: after `--help`, `--version`, a bad flag, `exo bench`, or a node that
            could not start (status 1, the reason logged).
    """
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["bench"]:
        from exo.benchmark.cli import main as bench_main

        raise SystemExit(bench_main(arguments[1:]))
    from exo.node_options import parse_args

    options = parse_args(arguments)
    from exo.main import run_node
    from exo.utils.memory_trace import start_tracing_from_environment

    start_tracing_from_environment()  # only with EXO_TRACEMALLOC (a test node's)

    run_node(options)
