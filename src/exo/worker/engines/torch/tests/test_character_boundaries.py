"""Generation never ends inside a character: whatever stops it (max tokens, the context's
end, EOS, a stop string), the text holds whole characters only, and the logprobs keep the
exact bytes of every token, those of an unfinished character included.

The tiny engine (real tokenizer) is made to write a scripted token sequence: the tokens of
text with multi-byte characters, which byte-level BPE splits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from exo.worker.engines.torch.distributed_engine import DistributedTorchEngine
from exo.worker.engines.torch.engine import GeneratedPiece, TorchEngine
from exo.worker.engines.torch.kv_cache import DecodeSession
from exo.worker.engines.torch.tests.test_engine import check_stream_shape, request
from exo.worker.engines.torch.vocabulary import split_incomplete_utf8

SCRIPTED_TEXT = "Hi 你好 😀 ✓ 🇫🇷 👨\u200d👩\u200d👧 日本語"


class ScriptedSession:
    """A decode session that runs no model: its logits make the next scripted token the
    only likely one (then EOS once the script is spent)."""

    def __init__(
        self, session: DecodeSession, script: list[int], eos_token_id: int, vocab_size: int
    ) -> None:
        self._session = session  # opened by the engine; closed with this one
        self._script = script
        self._eos_token_id = eos_token_id
        self._vocab_size = vocab_size
        self._step = 0

    def _next_logits(self) -> torch.Tensor:
        wanted = self._script[self._step] if self._step < len(self._script) else None
        self._step += 1
        logits = torch.zeros(self._vocab_size)  # [vocab]
        logits[self._eos_token_id if wanted is None else wanted] = 100.0
        return logits

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        return self._next_logits()

    def decode(self, token_id: int) -> torch.Tensor:
        return self._next_logits()

    def close(self) -> None:
        self._session.close()


def scripted_engine(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch, script: list[int]
) -> None:
    eos_token_id = min(engine.eos_token_ids)
    pool: Any = engine._cache_pool
    open_session = pool.open
    monkeypatch.setattr(
        pool,
        "open",
        lambda capacity: ScriptedSession(
            open_session(capacity), script, eos_token_id, engine.vocab_size
        ),
    )


def script_of(engine: TorchEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def generated_bytes(engine: TorchEngine, token_ids: list[int]) -> bytes:
    return b"".join(engine.vocabulary.token_bytes[token_id] for token_id in token_ids)


def text_of(pieces: list[GeneratedPiece]) -> str:
    return "".join(piece.text for piece in pieces)


def test_every_length_cut_ends_on_a_whole_character(
    tiny_engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = script_of(tiny_engine, SCRIPTED_TEXT)
    scripted_engine(tiny_engine, monkeypatch, script)
    cuts_inside_a_character = 0
    for max_tokens in range(1, len(script) + 1):
        pieces = list(
            tiny_engine.generate(
                request("Repeat", temperature=0.0, max_tokens=max_tokens, logprobs=True)
            )
        )
        check_stream_shape(pieces)
        token_ids = [token for piece in pieces for token in piece.token_ids]
        assert token_ids == script[:max_tokens]
        assert pieces[-1].finish_reason == "length"
        whole, unfinished = split_incomplete_utf8(generated_bytes(tiny_engine, token_ids))
        cuts_inside_a_character += bool(unfinished)
        text = text_of(pieces)
        assert "\ufffd" not in text, (max_tokens, text)
        assert text == whole.decode("utf-8")
        logprob_bytes = bytes(
            b for piece in pieces for entry in piece.logprobs for b in entry.bytes
        )
        assert logprob_bytes == whole + unfinished
    assert cuts_inside_a_character >= 5  # the script really splits characters


def first_token_of_an_emoji(engine: TorchEngine) -> int:
    emoji_tokens = script_of(engine, "😀")
    assert len(emoji_tokens) > 1  # byte-level BPE splits it
    return emoji_tokens[0]


def test_eos_after_an_unfinished_character(
    tiny_engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    unfinished = first_token_of_an_emoji(tiny_engine)
    scripted_engine(tiny_engine, monkeypatch, [*script_of(tiny_engine, "ok"), unfinished])
    pieces = list(tiny_engine.generate(request("Repeat", temperature=0.0, max_tokens=20)))
    assert pieces[-1].finish_reason == "stop" and pieces[-1].stop_sequence is None
    assert text_of(pieces) == "ok"


def test_stop_string_right_after_an_unfinished_character(
    tiny_engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    unfinished = first_token_of_an_emoji(tiny_engine)
    ok_tokens = script_of(tiny_engine, "ok")
    script = [*ok_tokens, unfinished, *script_of(tiny_engine, "!"), *ok_tokens]
    scripted_engine(tiny_engine, monkeypatch, script)
    pieces = list(
        tiny_engine.generate(request("Repeat", temperature=0.0, max_tokens=20, stop=("!",)))
    )
    assert pieces[-1].finish_reason == "stop" and pieces[-1].stop_sequence == "!"
    assert text_of(pieces) == "ok"


def test_distributed_engine_shares_the_decode_loop() -> None:
    # Rank 0 of a multi-rank instance runs the same loop (and detokenizer) as one rank, so
    # the tests above cover it; a loop of its own would need its own tests.
    assert DistributedTorchEngine._generate_tokens is TorchEngine._generate_tokens
