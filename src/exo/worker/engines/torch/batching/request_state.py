"""One generation request's state between steps, built in one place for every engine.

`RequestState` holds what turns the model's logits into streamed text for one request: the
prompt's token ids, the token budget, the `TokenChooser` (sampler with its own seeded
generator, penalties, logit bias, JSON / tool-call constraint), the streaming detokenizer,
the stop-string matcher, logprobs and the counters. The single-rank batching engine and the
multi-rank engines both build it with `build_request_state` and feed it one token at a time
with `accept`; neither repeats the finishing rules.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from exo.shared.types.chunks import FinishReason, TokenLogprob, Usage
from exo.shared.types.text_generation import SpeculativeMode
from exo.worker.engines.torch.batching.prompt_images import MultimodalPositions, PromptImage
from exo.worker.engines.torch.decoding.detokenizer import (
    StreamingDetokenizer,
    without_incomplete_end,
)
from exo.worker.engines.torch.decoding.sampling import SampledToken, StepLogprobs, TokenChooser
from exo.worker.engines.torch.decoding.stop_sequences import StopSequenceMatcher

_request_numbers = itertools.count(1)


def new_request_id() -> str:
    """A request id unique within this process ("req-1", "req-2", ...)."""
    return f"req-{next(_request_numbers)}"


@dataclass(slots=True)
class GeneratedPiece:
    """One streamed piece of generated text.

    `token_ids` are the tokens whose text this piece completes (several when a character or
    a possible stop string spanned tokens; none for a final piece that only carries the
    finish reason). `finish_reason` and `usage` are set on the last piece only. `logprobs`
    has one entry per token of `token_ids` when the request asked for logprobs, else none;
    except that a final piece ended by a stop string has none for its tokens whose text
    lies wholly in the stop string or after it (their text is not in the answer:
    llama-server leaves them out too), so its `logprobs` may be shorter than `token_ids`.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    usage: Usage | None
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_sequence: str | None = None


# The chosen token's logprob entry from the step's raw `[vocab]` logits, or from the
# logprobs another rank computed from them (engine's vocabulary).
LogprobFunction = Callable[[torch.Tensor | StepLogprobs, int, int], TokenLogprob]


@dataclass(slots=True, eq=False)
class RequestState:
    """A request from submission to its final piece.

    Attributes:
        request_id: the caller's id for the request (unique among running requests).
        prompt_ids: the rendered prompt's token ids.
        max_new_tokens: generated tokens allowed (`max_tokens` capped by the context and
            the engine's KV budget); at least 1.
        chooser: turns `[vocab]` logits into the next token.
        top_logprobs: None without logprobs, else how many alternatives per token.
        generated_ids: every sampled token (EOS included), in order.
        cached_tokens: prompt tokens whose KV came from the prefix cache.
        prefilled_tokens: prompt tokens whose KV is computed or being computed (the cached
            ones included); None until the request is first admitted to the batch.
        finished: the final piece was produced.
        images: the prompt's images (`prompt_images`), in prompt order; their tokens count
            among `prompt_ids` (and so in usage).
        positions: the multimodal rotary positions of a prompt with images (Qwen2.5-VL;
            `MultimodalPositions`); None: rotary positions are the token indices.
        speculative: whether the request verifies draft tokens (`speculative_policy`;
            None: the engine's default).
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    chooser: TokenChooser
    top_logprobs: int | None
    detokenizer: StreamingDetokenizer
    stop_matcher: StopSequenceMatcher
    eos_token_ids: frozenset[int]
    logprob_of: LogprobFunction
    generated_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prefilled_tokens: int | None = None
    finished: bool = False
    images: tuple[PromptImage, ...] = ()
    positions: MultimodalPositions | None = None
    speculative: SpeculativeMode | None = None
    _pending_ids: list[int] = field(default_factory=list)
    _pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Characters of text each pending token gave the stop matcher (0 for a token that
    # only began a character), to find the tokens a stop string cuts.
    _pending_text_lengths: list[int] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return len(self.generated_ids)

    @property
    def known_tokens(self) -> list[int]:
        """Prompt and generated tokens: what a recompute after pre-emption prefills (the
        last generated token has no KV yet; feeding it gives the next token's logits)."""
        return self.prompt_ids + self.generated_ids

    def accept(self, logits: torch.Tensor | SampledToken) -> list[GeneratedPiece]:
        """Choose the next token from this step's logits and advance the request.

        Args:
            logits: `[vocab]` raw scores of the request's last position, or the token a
                pipeline's last rank chose from them (with its logprobs when asked;
                `parallel/last_rank_sampling.py`).

        Returns:
            The pieces to stream, in order: none when the token's text is held back (an
            unfinished character, a possible stop string), its text, and/or the final piece
            (`finish_reason` set; `finished` is then True).

        Raises:
            NoAllowedTokenError: the constraint allows no token.
        """
        assert not self.finished, "a finished request takes no more tokens"
        return self._advance(self.chooser.choose(logits), logits)

    def force(self, token_ids: Sequence[int]) -> list[GeneratedPiece]:
        """Advance the request over tokens it generated before, elsewhere, without choosing
        them (mid-stream failover: `TextGenerationTaskParams.forced_token_ids`).

        Each token goes through what `accept` does after its choice — the detokenizer, stop
        matcher, penalties and constraint see it, it counts as generated — and the seeded
        sampler skips the draw it took (`Sampler.skip_draw`). The state afterwards is the
        one the unbroken run had after the same tokens: every later piece equals that run's
        given the same logits. The pieces returned are what was streamed for these tokens
        already (the runner feeds them to its output parser and drops them); tokens whose
        text is still held back at the end are taken as streamed too (the API sends only
        the tokens of whole pieces, so none normally are), keeping `logprobs` one per
        streamed token.

        Args:
            token_ids: the tokens, in generation order; the scheduler prefills them after the
                prompt (`known_tokens`) as it does a pre-empted request's.

        Returns:
            The pieces the tokens made, in order (no final one).

        Raises:
            ValueError: the tokens end the request (EOS, a stop string, the token budget or
                a complete constrained document), or one lies outside the chooser's rules
                (a constraint that forbids it).
        """
        pieces: list[GeneratedPiece] = []
        for token in token_ids:
            constraint = self.chooser.constraint
            if constraint is not None and not constraint.allowed(token):
                raise ValueError(f"forced token {token} breaks the request's output constraint")
            self.chooser.sampler.skip_draw()
            pieces += self._advance(token, None)
            if self.finished:
                raise ValueError("the forced tokens end the request; nothing is left to generate")
        self._pending_ids, self._pending_logprobs, self._pending_text_lengths = [], [], []
        return pieces

    def _advance(
        self, token: int, logits: torch.Tensor | SampledToken | None
    ) -> list[GeneratedPiece]:
        """Take `token` as the next generated token (`logits`: where it was chosen from, for
        its logprobs; None for a forced token, which has none)."""
        self.generated_ids.append(token)
        if token in self.eos_token_ids:
            return [self._final(*self._finish_text(), eos=True)]
        self.chooser.observe(token)
        self._pending_ids.append(token)
        if self.top_logprobs is not None and logits is not None:
            scores = logits.logprobs if isinstance(logits, SampledToken) else logits
            assert scores is not None, "a token chosen elsewhere came without its logprobs"
            self._pending_logprobs.append(self.logprob_of(scores, token, self.top_logprobs))
        pieces: list[GeneratedPiece] = []
        text = self.detokenizer.add_token(token)
        self._pending_text_lengths.append(len(text))
        if text:
            buffered = len(self.stop_matcher.held_text) + len(text)
            check = self.stop_matcher.feed(text)
            if check.stopped:
                self._drop_cut_logprobs(buffered, len(check.text))
                return [self._final(without_incomplete_end(check.text), check.stop)]
            if check.text:
                ids, logprobs = tuple(self._pending_ids), tuple(self._pending_logprobs)
                pieces.append(GeneratedPiece(check.text, ids, None, None, logprobs))
                self._pending_ids, self._pending_logprobs = [], []
                self._pending_text_lengths = []
        # A whole constrained document, or the token budget spent: nothing may follow.
        if self.chooser.is_complete or self.completion_tokens >= self.max_new_tokens:
            final_text, stop = self._finish_text()
            pieces.append(self._final(final_text, stop, eos=self.chooser.is_complete))
        return pieces

    def _finish_text(self) -> tuple[str, str | None]:
        """The text still held back when generation ends, and the stop string it completes
        (None when it completes none). The text never ends with the bytes of an unfinished
        character (`without_incomplete_end`)."""
        flushed = self.detokenizer.flush()
        buffered = len(self.stop_matcher.held_text) + len(flushed)
        check = self.stop_matcher.feed(flushed)
        if check.stopped:
            if self._pending_text_lengths:  # the flushed bytes are the last tokens'
                self._pending_text_lengths[-1] += len(flushed)
            self._drop_cut_logprobs(buffered, len(check.text))
            return without_incomplete_end(check.text), check.stop
        return check.text + self.stop_matcher.flush(), None

    def _drop_cut_logprobs(self, buffered: int, cut: int) -> None:
        """Drop the logprobs of the pending tokens whose text starts at or after `cut`: the
        stop string and what followed it, left out of the answer.

        Args:
            buffered: characters in the stop matcher's buffer when the stop was found (the
                pending tokens' text is its end).
            cut: where the answer's text ends in that buffer (the stop string's start).
        """
        if len(self._pending_logprobs) != len(self._pending_text_lengths):
            return  # forced tokens (no logprobs) among them: nothing to align with
        start = buffered - sum(self._pending_text_lengths)
        kept = 0
        for length in self._pending_text_lengths:
            if start >= cut:
                break
            kept += 1
            start += length
        del self._pending_logprobs[kept:]

    def accept_drafts(
        self,
        logits: torch.Tensor | Sequence[torch.Tensor | SampledToken],
        draft: Sequence[int],
        probabilities: torch.Tensor | None = None,
    ) -> tuple[list[GeneratedPiece], int]:
        """Verify a draft against the target's logits and advance the request by the tokens
        it keeps: a deterministic draft (n-gram, or any draft of a greedy request) as below,
        a drawn one with its draft distribution `probabilities` by `_accept_drawn_draft`.

        Row i of `logits` is the target's distribution after the request's text plus the
        first i draft tokens. Each row goes through `accept`, in order, exactly as plain
        decoding feeds it one step at a time: the chooser's penalties, logit bias,
        constraint and seeded sampler see the text as it stands at that row, and stop
        strings, `max_tokens`, usage and logprobs (from the row's raw logits) follow. The
        loop stops after the first row whose chosen token differs from the draft's (that
        token is the correction), when the request finishes, or after the last row (the
        bonus token).

        This is the rejection sampling of Leviathan et al. 2023 / Chen et al. 2023 for a
        draft distribution q that puts all its mass on the draft token t: accept t with
        probability min(1, p(t) / q(t)) = p(t), else draw from max(0, p - q) renormalised,
        which is p with t removed and renormalised. Drawing x ~ p with the key
        plain decoding would use (the race of `gumbel_race.py`) and accepting iff
        x == t does both at once: P(x = t) = p(t), and x given x != t follows p without t.
        So the output is distributed as the target's and, for one seed, is the very
        sequence plain decoding gives from the same logits (greedy: argmax == draft). A
        constrained request never chooses a token its grammar forbids, so such a draft
        token is rejected.

        Args:
            logits: `[len(draft) + 1, vocab]` raw scores, row i at the position after the
                i-th draft token (row 0: after the fed token); or, of a greedy request
                whose rows a pipeline's last rank chose (`accept`), one entry per row.
            draft: the draft tokens.
            probabilities: None, or `[len(draft), vocab]` the draft's distribution each
                token was drawn from (a draft model's; `speculative_drafts.Draft`).

        Returns:
            The pieces to stream (as `accept`'s, in order), and how many draft tokens were
            accepted (tokens emitted: that many plus one, or that many where the request
            finished on an accepted one).

        Raises:
            NoAllowedTokenError: the constraint allows no token.
        """
        assert len(logits) == len(draft) + 1, "one logits row per draft token and one more"
        if probabilities is not None and not self.chooser.sampler.params.is_greedy:
            assert isinstance(logits, torch.Tensor), "a drawn draft is verified on logits"
            return self._accept_drawn_draft(logits, draft, probabilities)
        pieces: list[GeneratedPiece] = []
        accepted = 0
        for row in range(len(draft) + 1):
            pieces += self.accept(logits[row])
            if row == len(draft) or self.generated_ids[-1] != draft[row]:
                break
            accepted += 1
            if self.finished:
                break
        return pieces, accepted

    def _accept_drawn_draft(
        self, logits: torch.Tensor, draft: Sequence[int], probabilities: torch.Tensor
    ) -> tuple[list[GeneratedPiece], int]:
        """The general rejection sampling of Leviathan et al. 2023 (Algorithm 1) / Chen et
        al. 2023 for draft tokens drawn from a distribution q (a draft model's), for a
        sampling request.

        Row by row, p is the distribution plain decoding would draw the token from at that
        row (`TokenChooser.distribution`: penalties, bias, temperature, top-k / top-p /
        min-p and the constraint applied to the text as it stands there). Draft token t is
        accepted with probability min(1, p(t) / q(t)) (a uniform u from the next key of the
        request's seeded generator, accepted iff u q(t) < p(t)); else the row's token is
        drawn from max(0, p - q) renormalised (the race over it, `Sampler.draw`) and the
        loop stops; after every draft token is accepted the last row's bonus token is drawn
        from p. The tokens kept are then distributed as the target's (the papers' theorem),
        and a seed and the same drafts give the same output. A token the grammar forbids has
        p(t) = 0 and is always rejected. Each kept token goes through `_advance` as in
        `accept` (stop strings, budget, logprobs from the row's raw logits).

        Args:
            logits: `[len(draft) + 1, vocab]` raw scores (see `accept_drafts`).
            draft: the draft tokens.
            probabilities: `[len(draft), vocab]` q at each draft token.

        Returns:
            As `accept_drafts`.
        """
        assert not self.finished, "a finished request takes no more tokens"
        sampler = self.chooser.sampler
        pieces: list[GeneratedPiece] = []
        accepted = 0
        for row in range(len(draft) + 1):
            target = self.chooser.distribution(logits[row])  # [vocab] float64, p
            if row == len(draft):
                token = sampler.draw(target)
            else:
                guess = draft[row]
                proposal = probabilities[row].to(torch.float64)  # [vocab], q
                if sampler.next_uniform() * float(proposal[guess]) < float(target[guess]):
                    token = guess
                else:
                    residual = (target - proposal[: target.shape[0]]).clamp_min_(0.0)
                    # p - q has mass wherever a rejection is possible (q(t) > p(t) somewhere).
                    token = sampler.draw(residual if float(residual.sum()) > 0.0 else target)
            pieces += self._advance(token, logits[row])
            if row == len(draft) or token != draft[row]:
                break
            accepted += 1
            if self.finished:
                break
        return pieces, accepted

    def _final(self, text: str, stop: str | None, eos: bool = False) -> GeneratedPiece:
        """The last piece: "stop" at EOS, a stop string or a complete constrained document,
        else "length"."""
        self.finished = True
        usage = Usage(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=self.completion_tokens,
            cached_tokens=min(self.cached_tokens, len(self.prompt_ids)),
        )
        reason: FinishReason = "stop" if eos or stop is not None else "length"
        piece = GeneratedPiece(
            text, tuple(self._pending_ids), reason, usage, tuple(self._pending_logprobs), stop
        )
        self._pending_ids, self._pending_logprobs, self._pending_text_lengths = [], [], []
        return piece
