"""Client model names mapped to served models (`--model-alias 'claude-*=qwen3:8b'`).

Coding agents ask for their own vendor's models (Claude Code `claude-sonnet-4-5` and
`claude-haiku-4-5`, Codex `gpt-5-codex`) unless told otherwise. An alias maps such names,
by a shell-style pattern (`*` any run of characters, `?` one), to a model of the cluster.
A name the cluster knows itself is never aliased; otherwise the first matching alias, in
the order given, decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase


@dataclass(frozen=True, slots=True)
class ModelAlias:
    """Names matching `pattern` (case-sensitive, `*` and `?` wildcards) mean `model`."""

    pattern: str
    model: str


def parse_model_alias(text: str) -> ModelAlias:
    """`PATTERN=MODEL` as an alias.

    Raises:
        ValueError: no `=`, or an empty side.
    """
    pattern, separator, model = text.partition("=")
    pattern, model = pattern.strip(), model.strip()
    if not separator or not pattern or not model:
        raise ValueError(f"{text!r} is not PATTERN=MODEL (such as 'claude-*=qwen3:8b')")
    return ModelAlias(pattern, model)


def parse_model_aliases(texts: Sequence[str]) -> tuple[ModelAlias, ...]:
    """Every alias of `texts`, each `PATTERN=MODEL` or several of them comma-separated.

    Raises:
        ValueError: one is not `PATTERN=MODEL`.
    """
    return tuple(
        parse_model_alias(part) for text in texts for part in text.split(",") if part.strip()
    )


def aliased_model(aliases: Sequence[ModelAlias], name: str) -> str | None:
    """The model the first alias matching `name` names, or None."""
    for alias in aliases:
        if fnmatchcase(name, alias.pattern):
            return alias.model
    return None
