"""The chaos suite: each test injects one fault into real nodes under load; see
tests/chaos/scenarios.py for what each checks (`bench/chaos.py` runs the same scenarios, each
on fresh nodes, and prints their table). In the default run: the link cut in a network
namespace and restored (here, on two namespaced nodes of its own); the short SIGKILL
scenarios (a runner, the master, a pipeline rank's node mid-stream) run in
tests/test_failover.py, on the 3-node cluster the failover tests use. The long ones (a node
stopped for 40 s, a truncated event log, a full models disk) with `pytest -m chaos`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.chaos import disk, partition, scenarios
from tests.chaos.harness import Row

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("mount") is None,
    reason="needs root, iproute2 and mount (network namespaces, a tmpfs)",
)

# Each scenario on fresh nodes (`bench/chaos.py`).
SHORT: list[Callable[[Path, Path], Row]] = [
    scenarios.runner_killed_mid_stream,
    scenarios.master_killed_mid_stream,
    scenarios.pipeline_rank_node_killed,
]
LONG: list[Callable[[Path, Path], Row]] = [
    scenarios.node_stopped_40_s,
    scenarios.event_log_truncated_while_stopped,
]
ROOT_SHORT: list[Callable[[Path, Path], Row]] = [partition.link_cut_and_restored]
ROOT_LONG: list[Callable[[Path, Path], Row]] = [disk.models_disk_full_during_download]


def _cases(
    short: list[Callable[[Path, Path], Row]], long: list[Callable[[Path, Path], Row]]
) -> list[Any]:
    """The short scenarios as they are (default run), the long ones marked `chaos`."""
    return [pytest.param(scenario, id=scenario.__name__) for scenario in short] + [
        pytest.param(scenario, id=scenario.__name__, marks=pytest.mark.chaos) for scenario in long
    ]


# SHORT plays on the failover tests' shared cluster in the default run (tests/test_failover.py);
# here only the long scenarios, each on fresh nodes.
SCENARIOS = _cases([], LONG)
ROOT_SCENARIOS = _cases(ROOT_SHORT, ROOT_LONG)

pytestmark = [pytest.mark.timeout(1800)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fault(
    scenario: Callable[[Path, Path], Row], tmp_path: Path, shared_models_dir: Path
) -> None:
    row = scenario(tmp_path, shared_models_dir)
    print(row.as_dict())
    assert row.recovery_s is not None


@needs_root
@pytest.mark.parametrize("scenario", ROOT_SCENARIOS)
def test_fault_needing_root(
    scenario: Callable[[Path, Path], Row], tmp_path: Path, shared_models_dir: Path
) -> None:
    row = scenario(tmp_path, shared_models_dir)
    print(row.as_dict())
    assert row.recovery_s is not None
