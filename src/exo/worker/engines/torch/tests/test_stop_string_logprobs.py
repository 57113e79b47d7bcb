"""A stop string cuts the answer's text, and the logprobs of the tokens whose text it cut
go with it (llama-server leaves the stop word's tokens out of its probabilities too): the
final piece keeps logprobs only for tokens whose text starts before the stop string, so a
token partly kept ("buy" + " apples" cut at "apples") keeps its entry and the tokens wholly
in or after the stop string have none. Before, the answer ended "buy " while its logprobs
ended ' apples', ',', ' oranges'."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from exo.shared.types.chunks import TokenLogprob
from exo.worker.engines.torch.batching.request_state import GeneratedPiece, RequestState
from exo.worker.engines.torch.decoding.detokenizer import StreamingDetokenizer
from exo.worker.engines.torch.decoding.sampling import Sampler, TokenChooser
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.decoding.stop_sequences import StopSequenceMatcher

WORDS = ["<s>", "I", " buy", " apples", ",", " oranges", " and", " pears"]


def _state(stop: Sequence[str], max_tokens: int = 20) -> RequestState:
    return RequestState(
        request_id="r",
        prompt_ids=[0],
        max_new_tokens=max_tokens,
        chooser=TokenChooser(Sampler(SamplingParams())),  # greedy
        top_logprobs=0,
        detokenizer=StreamingDetokenizer(lambda ids: "".join(WORDS[i] for i in ids), [0]),
        stop_matcher=StopSequenceMatcher(stop),
        eos_token_ids=frozenset(),
        logprob_of=lambda logits, token, top: TokenLogprob(
            token=WORDS[token], token_id=token, logprob=-0.5
        ),
    )


def _generate(state: RequestState, tokens: Sequence[int]) -> list[GeneratedPiece]:
    """Feed `tokens` as greedy choices until the request ends."""
    pieces: list[GeneratedPiece] = []
    for token in tokens:
        logits = torch.zeros(len(WORDS))
        logits[token] = 10.0
        pieces += state.accept(logits)
        if state.finished:
            break
    return pieces


SENTENCE = [1, 2, 3, 4, 5, 6, 7]  # "I buy apples, oranges and pears"


@pytest.mark.parametrize(
    ("stop", "text", "logprob_tokens"),
    [
        (", oranges", "I buy apples", ["I", " buy", " apples"]),
        ("apples", "I buy ", ["I", " buy", " apples"]),  # " apples" is partly kept
        ("apples, oranges", "I buy ", ["I", " buy", " apples"]),
        (" apples, oranges and", "I buy", ["I", " buy"]),
        ("I", "", []),
    ],
)
def test_tokens_a_stop_string_cuts_lose_their_logprobs(
    stop: str, text: str, logprob_tokens: list[str]
) -> None:
    pieces = _generate(_state([stop]), SENTENCE)
    final = pieces[-1]
    assert (final.finish_reason, final.stop_sequence) == ("stop", stop)
    assert "".join(piece.text for piece in pieces) == text
    assert [entry.token for piece in pieces for entry in piece.logprobs] == logprob_tokens
    # The tokens were generated all the same: their ids stay (usage, failover).
    generated = [token for piece in pieces for token in piece.token_ids]
    assert generated == SENTENCE[: len(generated)]


def test_without_a_stop_string_every_token_keeps_its_logprob() -> None:
    pieces = _generate(_state(["zebra"], max_tokens=len(SENTENCE)), SENTENCE)
    assert pieces[-1].finish_reason == "length"
    assert "".join(piece.text for piece in pieces) == "I buy apples, oranges and pears"
    assert sum(len(piece.logprobs) for piece in pieces) == len(SENTENCE)
