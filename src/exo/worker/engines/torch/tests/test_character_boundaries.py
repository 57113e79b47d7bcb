"""Generation never ends inside a character: whatever stops it (max tokens, the context's
end, EOS, a stop string), the text holds whole characters only, and the logprobs keep the
exact bytes of every token, those of an unfinished character included.

The tiny engine (real tokenizer) is made to write a scripted token sequence: the tokens of
text with multi-byte characters, which byte-level BPE splits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from exo.worker.engines.torch.batching import scheduler as scheduler_module
from exo.worker.engines.torch.decoding.vocabulary import split_incomplete_utf8
from exo.worker.engines.torch.engine import GeneratedPiece, TorchEngine
from exo.worker.engines.torch.engine_requests import RequestHandle
from exo.worker.engines.torch.tests.test_engine import check_stream_shape, request

SCRIPTED_TEXT = "Hi 你好 😀 ✓ 🇫🇷 👨\u200d👩\u200d👧 日本語"


def scripted_engine(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch, script: list[int]
) -> None:
    """Make every step's logits favour only the next scripted token (then EOS once the
    script is spent), from the start of the script for each submitted request (one at a
    time); the model still runs, so the KV cache is filled as usual."""
    eos_token_id = min(engine.eos_token_ids)
    forward = scheduler_module.forward_batch
    submit = engine.submit
    position = 0

    def submit_from_the_start(*args: Any, **kwargs: Any) -> RequestHandle:
        nonlocal position
        position = 0
        return submit(*args, **kwargs)

    def scripted_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal position
        logits = torch.zeros_like(forward(*args, **kwargs))  # [rows, vocab]
        for row in range(logits.shape[0]):
            wanted = script[position] if position < len(script) else eos_token_id
            logits[row, wanted] = 100.0
            position += 1
        return logits

    monkeypatch.setattr(scheduler_module, "forward_batch", scripted_forward)
    monkeypatch.setattr(engine, "submit", submit_from_the_start)


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
