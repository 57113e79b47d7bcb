"""The runner's check of its card against the model it loaded (`exo.shared.models.profile`):
what placement read from the card and what the model's files say, reported once at load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loguru import logger

from exo.chat_protocol.prompt import detect_tool_call_format
from exo.shared.models.profile import card_mismatches
from exo.shared.types.models import ModelCard


def check_card(card: ModelCard, model_dir: Path, tokenizer: Any) -> tuple[str, ...]:
    """The facts `card` states otherwise than the model in `model_dir` (its `config.json`)
    and its tokenizer (the tool-call format its chat template shows), logged as a warning
    when there are any. A model directory without a readable `config.json` is checked
    against the tokenizer only."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    found = card_mismatches(card, config, detect_tool_call_format(tokenizer))
    if found:
        logger.warning(
            f"the card of {card.model_id} disagrees with its model's files (placement and "
            f"memory used the card): {'; '.join(found)}"
        )
    return found
