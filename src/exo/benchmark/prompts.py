"""Random prompts of a given length in tokens, and the EOS ids to ban, from a model's files.

Every run gets a fresh random prompt (seeded by the run's index), so no run reuses another's
KV through the prefix cache, and the EOS ids get a logit bias of -100 so each run decodes
exactly the requested number of tokens.
"""

from __future__ import annotations

import contextlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo.chat_protocol.tokenizer_loading import load_tokenizer

# Prompts are re-tokenised a few times until decode(encode(text)) is stable at the length.
PROMPT_FIT_ROUNDS = 4
EOS_BIAS = -100.0


@dataclass(frozen=True)
class ModelText:
    """A model's tokenizer and EOS token ids, read from its Hugging Face-format directory."""

    tokenizer: Any
    eos_token_ids: frozenset[int]
    vocab_size: int
    """Token ids below this are ones both the tokenizer and the model's embedding hold (a
    tokenizer may name more ids than the embedding has rows: those are never drawn)."""

    @classmethod
    def load(cls, model_dir: Path) -> ModelText:
        """Read `model_dir`'s tokenizer and every EOS id its config, generation config and
        tokenizer name.

        Raises:
            ValueError: no EOS id is named anywhere.
        """
        tokenizer = load_tokenizer(model_dir)
        ids: set[int] = set()
        candidates: list[Any] = [tokenizer.eos_token_id]
        vocab_size = len(tokenizer)
        for name in ("config.json", "generation_config.json"):
            with contextlib.suppress(OSError, ValueError):
                config = json.loads((model_dir / name).read_text())
                candidates.append(config.get("eos_token_id"))
                candidates.append(config.get("text_config", {}).get("eos_token_id"))
                rows = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
                if isinstance(rows, int):
                    vocab_size = min(vocab_size, rows)
        for candidate in candidates:
            if isinstance(candidate, int):
                ids.add(candidate)
            elif isinstance(candidate, list):
                ids.update(int(item) for item in candidate)
        if not ids:
            raise ValueError(f"{model_dir}: no EOS token id in its config or tokenizer")
        return cls(tokenizer, frozenset(ids), vocab_size)

    def logit_bias(self) -> dict[str, float]:
        """The request's `logit_bias` banning every EOS id (JSON keys are strings)."""
        return {str(token_id): EOS_BIAS for token_id in sorted(self.eos_token_ids)}

    def _ordinary_ids(self) -> list[int]:
        special = set(self.tokenizer.all_special_ids) | set(self.eos_token_ids)
        return [token_id for token_id in range(self.vocab_size) if token_id not in special]

    def random_token_ids(self, length: int, seed: int) -> list[int]:
        """`length` random ordinary (not special, not EOS) token ids."""
        rng = random.Random(seed)
        ordinary = self._ordinary_ids()
        return [rng.choice(ordinary) for _ in range(length)]

    def random_prompt(self, length: int, seed: int) -> tuple[str, int]:
        """A random text that this tokenizer encodes (without special tokens) into about
        `length` tokens; returns it with its exact length in tokens."""
        ids = self.random_token_ids(length, seed)
        text = ""
        for _ in range(PROMPT_FIT_ROUNDS):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == length:
                return text, length
            if len(encoded) < length:
                extra = self.random_token_ids(length - len(encoded), seed + len(encoded))
                encoded = encoded + extra
            ids = encoded[:length]
        return text, len(self.tokenizer.encode(text, add_special_tokens=False))
