"""`exo bench --suite` is named for what it measures; its old name stays for one release."""

import pytest

from exo.benchmark.cli import SPEED_TARGETS_SUITE, SUITE_ALIASES, parse_arguments
from exo.benchmark.suite import SUITE_NAME


def test_the_suite_is_named_for_what_it_measures_and_writes_its_file_under_that_name() -> None:
    assert parse_arguments(["--suite", "speed-targets"]).suite == SPEED_TARGETS_SUITE
    assert SUITE_NAME == SPEED_TARGETS_SUITE == "speed-targets"


def test_the_old_name_is_still_accepted_as_an_alias() -> None:
    assert parse_arguments(["--suite", "issue14"]).suite == "issue14"
    assert SUITE_ALIASES == {"issue14": SPEED_TARGETS_SUITE}


def test_an_unknown_suite_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_arguments(["--suite", "issue15"])
