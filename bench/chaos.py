"""The chaos suite as a table: every scenario of tests/chaos (the same functions
`pytest -m chaos` runs), one after another, each on fresh nodes; prints fault, recovery time
(seconds from the fault until the cluster serves again; for the full disk, until the
download's failure is reported), requests affected, how many failed cleanly and how many
ended uncleanly (must be 0), and writes JSON.

Usage: python bench/chaos.py [--only NAME ...] [--json PATH]
       [--models-dir DIR]
The link-cut and full-disk scenarios need root (network namespaces, a tmpfs). Times depend
on the machine's load: on a loaded machine they are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

# The scenarios live in the repository's tests package: put the repository root on sys.path so
# the script runs as docs/testing.md writes it, from the root with only the package installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chaos.harness import Row, format_table
from tests.chaos.test_chaos import LONG, ROOT_LONG, ROOT_SHORT, SHORT

from exo.shared.constants import models_dir as default_models_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--only", nargs="*", default=None, help="scenario function names")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--models-dir", type=Path, default=None)
    arguments = parser.parse_args()
    models = arguments.models_dir or default_models_dir()
    rows: list[Row] = []
    for scenario in [*SHORT, *LONG, *ROOT_SHORT, *ROOT_LONG]:
        if arguments.only and scenario.__name__ not in arguments.only:
            continue
        print(f"== {scenario.__name__}", flush=True)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"exo-chaos-{scenario.__name__}-") as root:
            try:
                row = scenario(Path(root), models)
            except Exception as error:
                traceback.print_exc()
                row = Row(scenario.__name__, error=f"{type(error).__name__}: {error}")
        print(f"== {scenario.__name__}: {time.monotonic() - started:.0f} s", flush=True)
        rows.append(row)
        print(format_table(rows), flush=True)
    print(format_table(rows))
    if arguments.json is not None:
        arguments.json.write_text(json.dumps([row.as_dict() for row in rows], indent=2))
    return 0 if all(row.error is None for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
