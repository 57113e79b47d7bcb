"""The `exo` entry point answers `--help`, `--version`, a bad flag and `exo bench --help`
without importing the node (torch, transformers, the API: ~6 s on a 2-core machine)."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "exo.main", "exo.api.app")
CHECK = """
import sys
from pathlib import Path
from exo.cli import main
try:
    main({arguments!r})
except SystemExit as stop:
    code = stop.code
loaded = [name for name in {heavy!r} if name in sys.modules]
print("CODE", code, "LOADED", ",".join(loaded))
"""


@pytest.mark.parametrize(
    ("arguments", "code"),
    [(["--help"], 0), (["--version"], 0), (["--bogus"], 2), (["bench", "--help"], 0)],
)
def test_the_command_line_answers_without_the_node(arguments: list[str], code: int) -> None:
    script = CHECK.format(arguments=arguments, heavy=HEAVY)
    finished = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    assert f"CODE {code} LOADED \n" in finished.stdout, finished.stdout + finished.stderr


def test_version_prints_the_installed_package_version() -> None:
    finished = subprocess.run(
        [sys.executable, "-m", "exo", "--version"], capture_output=True, text=True, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout == f"exo {importlib.metadata.version('exo')}\n"


def test_decode_activations_reach_the_runners_options() -> None:
    """`--decode-activations` parses to the node's options (int16 by default) and refuses
    other values; main.py hands it to every runner (`RunnerOptions.decode_activations`)."""
    from exo.node_options import parse_args
    from exo.worker.runner.options import RunnerOptions

    assert parse_args([]).decode_activations == "int16"
    assert parse_args(["--decode-activations", "int8"]).decode_activations == "int8"
    with pytest.raises(SystemExit):
        parse_args(["--decode-activations", "int4"])
    assert RunnerOptions(decode_activations="int8").decode_activations == "int8"


def test_a_draft_model_naming_nothing_is_a_flag_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--draft-model` must be a catalog model (any of its names) or a model directory on
    this node: the only drafts a runner can load (`drafts.draft_option_problem`). Anything
    else stops the node at start with one error line, before it places anything."""
    from exo.node_options import parse_args
    from exo.testing.tiny_models import save_tiny_checkout

    assert parse_args(["--draft-model", "smollm2:135m"]).draft_model == "smollm2:135m"
    draft = save_tiny_checkout(tmp_path / "draft")
    assert parse_args(["--draft-model", str(draft)]).draft_model == str(draft)
    for name, reason in [
        ("nope/none", "names no catalog model and no model directory on this node"),
        ("none", "names no catalog model and no model directory on this node"),
        (str(tmp_path), "has no config.json"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            parse_args(["--draft-model", name])
        assert stopped.value.code == 2
        (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert line.startswith(f"exo: error: --draft-model {name!r}"), line
        assert reason in line, line


def test_speculation_flags_reach_the_runners_options_and_bad_bounds_are_a_flag_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--speculative` (on / off / auto), `--draft-min` and `--draft-max` parse to the node's
    options and main.py's `RunnerOptions`; a minimum above the maximum (or under 1) stops
    the node at start with one error line. What a request without `speculative` does with
    the node's default: `test_speculative_requests.py`."""
    from exo.node_options import parse_args
    from exo.shared.types.text_generation import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_MIN
    from exo.worker.runner.options import RunnerOptions

    defaults = parse_args([])
    assert (defaults.speculative, defaults.draft_min, defaults.draft_max) == (
        "auto", DEFAULT_DRAFT_MIN, DEFAULT_DRAFT_MAX,
    )  # fmt: skip
    for flag, mode in (("on", True), ("off", False), ("auto", "auto")):
        assert parse_args(["--speculative", flag]).speculative == mode
    options = parse_args(["--speculative", "off", "--draft-min", "2", "--draft-max", "5"])
    runner = RunnerOptions(
        speculative=options.speculative, draft_min=options.draft_min, draft_max=options.draft_max
    )
    assert (runner.speculative, runner.draft_min, runner.draft_max) == (False, 2, 5)
    assert parse_args(["--draft-min", "3", "--draft-max", "3"]).draft_max == 3
    for arguments in (["--draft-min", "6", "--draft-max", "5"], ["--draft-min", "0"]):
        with pytest.raises(SystemExit) as stopped:
            parse_args(arguments)
        assert stopped.value.code == 2
        (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert "--draft-min and --draft-max need 1 <= min <= max" in line, line
    with pytest.raises(SystemExit):
        parse_args(["--speculative", "sometimes"])
