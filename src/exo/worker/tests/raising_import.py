"""A module whose import fails with something other than ImportError, on purpose: the runner
server's preload in `test_runner_start_method.py` imports it, and such a failure ends the
server (`multiprocessing.forkserver` forgives only ImportError)."""

raise RuntimeError("this module fails to import, on purpose")
