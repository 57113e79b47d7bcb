"""The chaos suite (`pytest -m chaos`, not in the default run; `bench/chaos.py` runs the same
scenarios and prints their table). Each test injects one fault into real nodes under load;
see tests/chaos/scenarios.py for what each checks. Runs for tens of minutes on a loaded
2-core machine."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chaos import disk, partition, scenarios
from tests.chaos.harness import Row

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("mount") is None,
    reason="needs root, iproute2 and mount (network namespaces, a tmpfs)",
)

SCENARIOS: list[Callable[[Path, Path], Row]] = [
    scenarios.runner_killed_mid_stream,
    scenarios.master_killed_mid_stream,
    scenarios.pipeline_rank_node_killed,
    scenarios.node_stopped_40_s,
    scenarios.event_log_truncated_while_stopped,
]
ROOT_SCENARIOS: list[Callable[[Path, Path], Row]] = [
    disk.models_disk_full_during_download,
    partition.link_cut_and_restored,
]

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1800)]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_fault(
    scenario: Callable[[Path, Path], Row], tmp_path: Path, shared_models_dir: Path
) -> None:
    row = scenario(tmp_path, shared_models_dir)
    print(row.as_dict())
    assert row.recovery_s is not None


@needs_root
@pytest.mark.parametrize("scenario", ROOT_SCENARIOS, ids=lambda s: s.__name__)
def test_fault_needing_root(
    scenario: Callable[[Path, Path], Row], tmp_path: Path, shared_models_dir: Path
) -> None:
    row = scenario(tmp_path, shared_models_dir)
    print(row.as_dict())
    assert row.recovery_s is not None
