"""A reply fixed in advance: a constraint that allows exactly the next token of a given
token sequence, then ends the generation (`is_complete`) as an end-of-sequence token would.

Only the engine's test seam uses it (`exo.worker.engines.torch.testing_seam`): a live node
whose model directory the tests marked answers chosen prompts with chosen text — a tool
call an agent client must run, a stop in mid-sentence — through the real runner, batching,
detokenizer, tool-call parser and every API dialect.
"""

from __future__ import annotations

from collections.abc import Sequence


class ScriptedReply:
    """Allows `token_ids[k]` as the k-th generated token and nothing else; complete once
    every token is out (the request then finishes as if the model wrote end-of-sequence).

    Raises (from `allowed_tokens`' caller): `NoAllowedTokenError` never, since one token is
    always allowed until the reply is complete.
    """

    __slots__ = ("_next", "_token_ids")

    def __init__(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("a scripted reply needs at least one token")
        self._token_ids = tuple(token_ids)
        self._next = 0

    @property
    def is_complete(self) -> bool:
        return self._next >= len(self._token_ids)

    def allowed(self, token_id: int) -> bool:
        return not self.is_complete and token_id == self._token_ids[self._next]

    def allowed_tokens(self) -> list[int]:
        return [] if self.is_complete else [self._token_ids[self._next]]

    def advance(self, token_id: int) -> None:
        if not self.allowed(token_id):
            raise ValueError(f"token {token_id} is not the scripted reply's next token")
        self._next += 1
