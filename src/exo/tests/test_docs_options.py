"""The options page is what the parsers generate, and every `--help` text is one line."""

import re
from pathlib import Path

from exo.docs_options import (
    ENVIRONMENT,
    MAX_HELP_CHARACTERS,
    REGENERATE,
    all_option_helps,
    render,
)

ROOT = Path(__file__).resolve().parents[3]
SOURCE = ROOT / "src" / "exo"


def test_the_committed_options_page_is_what_the_parsers_generate() -> None:
    committed = (ROOT / "docs" / "options.md").read_text()
    assert committed == render(), f"docs/options.md is stale: run `{REGENERATE}`"


def test_every_help_text_is_one_sentence_of_at_most_120_characters_with_its_default() -> None:
    too_long = [
        f"{option.invocation}: {len(option.help)} characters: {option.help}"
        for option in all_option_helps()
        if len(option.help) > MAX_HELP_CHARACTERS
    ]
    assert not too_long, (
        f"--help texts over {MAX_HELP_CHARACTERS} characters (as rendered, default "
        "included); move the details to the docs page the option links to:\n" + "\n".join(too_long)
    )
    for option in all_option_helps():
        # A second sentence starts after a full stop ("e.g. tcp/..." is no full stop).
        assert not re.search(r"\. [A-Z]", option.help), option
        if option.dest not in ("help", "version"):
            assert "default" in option.help, f"{option.invocation} does not give its default"


def test_every_exo_environment_variable_read_in_the_code_is_on_the_options_page() -> None:
    listed = {variable.name for variable in ENVIRONMENT}
    read = {
        name
        for path in SOURCE.rglob("*.py")
        if "tests" not in path.parts
        and path.parent.name != "testing"
        and path.name != "docs_options.py"
        for name in re.findall(r"\bEXO_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    assert read - listed == set(), "add these to ENVIRONMENT in exo.docs_options"
