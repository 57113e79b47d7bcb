"""Token sampling: penalties, logit bias, temperature, top-k, top-p (nucleus), min-p,
per-request seed, optional constraints on which tokens may be drawn, and log probabilities.

Penalties come first (on the model's logits), then the logit bias, then the filters in the
order Hugging Face transformers' logits processors use: temperature, then top-k, then
top-p, then min-p (min-p: Nguyen et al. 2024, "Turning Up the Heat"). A sampled token is the
winner of a Gumbel-max race over the filters' candidates, keyed by one key per draw from the
request's generator (`gumbel_race.py`), so a seed's tokens survive the tiny logit changes of
another computation path (a prefix-cache hit, a batch, a split).
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from exo.shared.types.chunks import MIN_LOGPROB
from exo.worker.engines.torch.decoding.gumbel_race import (
    draw_key,
    gumbel_scores,
    key_uniform,
    race_index,
    race_probabilities,
    race_winner,
)
from exo.worker.engines.torch.decoding.logit_adjustments import LogitBias, TokenPenalties
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams


def argmax_token(scores: torch.Tensor) -> int:
    """The index of the largest of `scores` `[n]` (the first of equal ones; a NaN counts as
    the largest, as in `torch.argmax`).

    numpy's argmax where the scores are float32 on the CPU: torch's is many times slower
    over a large vocabulary (figures: docs/benchmarks/engine-design-figures.md#samplingpy).
    """
    if scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 1:
        return int(scores.detach().contiguous().numpy().argmax())
    return int(torch.argmax(scores).item())


# The most likely tokens examined first for the top-p nucleus (doubled while they hold less
# than top_p of the mass), instead of sorting the whole vocabulary: a sort of the whole
# vocabulary can take longer than the decode step itself, a top-k of 256 a small part of it
# (figures: docs/benchmarks/engine-design-figures.md#samplingpy).
NUCLEUS_CANDIDATES = 256


def sampling_candidates(
    logits: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens that temperature, top-k, top-p and min-p leave, with their tempered scores.

    top-p keeps, in order of likelihood, each token while the mass of the tokens before it
    (probabilities after top-k) is below top_p, so the most likely token always survives;
    min-p keeps the tokens whose probability is at least min_p times the largest
    (`score >= best + ln(min_p)`). The nucleus is found among the `NUCLEUS_CANDIDATES`
    most likely tokens (more when they hold less than top_p): the same set as a full sort
    gives, up to the order of equal scores.

    Args:
        logits: `[vocab]` float scores.
        params: the sampling settings; temperature must be > 0.

    Returns:
        `(ids, scores)`: ids `[C]` int64 and their float32 scores divided by the
        temperature, most likely first; or `(None, scores [vocab])` when every token is
        kept.
    """
    scores = logits.float() / params.temperature
    vocab_size = scores.shape[-1]
    limit = params.top_k if 0 < params.top_k < vocab_size else vocab_size
    ids: torch.Tensor | None = None
    kept = scores
    if params.top_p < 1.0:
        # Probabilities as softmax forms them, exp(score - best) over their sum, in float64:
        # float32 sums over thousands of tokens move the cut by a few tokens.
        if limit < vocab_size:
            top_scores, top_ids = torch.topk(scores, limit)
            best = top_scores[0]
            total = torch.exp((top_scores - best).double()).sum()
        else:
            best = scores.max()
            total = torch.exp((scores - best).double()).sum()
        taken = limit if limit < vocab_size else min(limit, NUCLEUS_CANDIDATES)
        while True:
            if limit == vocab_size or taken < limit:
                top_scores, top_ids = torch.topk(scores, taken)
            probs = torch.exp((top_scores[:taken] - best).double()) / total
            mass_before = torch.cumsum(probs, dim=-1) - probs
            count = max(1, int((mass_before < params.top_p).sum()))
            if count < taken or taken == limit:
                break
            taken = min(2 * taken, limit)
        ids, kept = top_ids[:count], top_scores[:count]
    elif limit < vocab_size:
        kept, ids = torch.topk(scores, limit)
    if params.min_p > 0.0:
        keep = kept >= kept.max() + math.log(params.min_p)
        if ids is None:
            ids = keep.nonzero().squeeze(1)
            kept = scores.index_select(0, ids)
        else:
            ids, kept = ids[keep], kept[keep]
    return ids, kept


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p to one step's logits
    (`sampling_candidates`).

    Args:
        logits: `[vocab]` float scores.
        params: the sampling settings; temperature must be > 0.

    Returns:
        `[vocab]` float32 logits with filtered-out tokens at -inf (at least one token kept).
    """
    ids, kept = sampling_candidates(logits, params)
    if ids is None:
        return kept
    filtered = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)
    return filtered.index_copy_(0, ids, kept)


# Rejection sampling under a constraint: this many draws (each one masking the rejected
# token) before computing the whole allowed set instead.
MAX_REJECTIONS = 32
# Greedy decoding checks this many of the most likely tokens, in order, before computing
# the whole allowed set.
SCAN_BLOCK = 256


class TokenFilter(Protocol):
    """Which tokens may be drawn next (`constraints.TokenConstraint`)."""

    def allowed(self, token_id: int) -> bool: ...

    def allowed_tokens(self) -> list[int]: ...


class OutputConstraint(TokenFilter, Protocol):
    """A filter that follows the generated tokens and can end the generation
    (`constraints.TokenConstraint`, `scripted.ScriptedReply`)."""

    @property
    def is_complete(self) -> bool: ...

    def advance(self, token_id: int) -> None: ...


class NoAllowedTokenError(RuntimeError):
    """A constraint rejected every token of the vocabulary."""


def sample_unconstrained(logits: torch.Tensor, params: SamplingParams, key: int) -> int:
    """The token an unconstrained `Sampler.sample` picks: the argmax when greedy, else the
    Gumbel-max race with `key` over the tokens `sampling_candidates` leaves
    (`gumbel_race.py`; a pipeline's last rank calls it with the key rank 0's `Sampler.key`
    drew, so both pick alike).

    Args:
        logits: `[vocab]` scores of the last position.
        key: the draw's key; unused when greedy.
    """
    if params.is_greedy:
        return argmax_token(logits)
    ids, kept = sampling_candidates(logits, params)
    drawn = race_index(kept, ids, key)
    return drawn if ids is None else int(ids[drawn])


class Sampler:
    """Draws tokens for one request with its own random generator, so a seed reproduces the
    same tokens regardless of other requests.

    Each draw takes one key from the generator, in order (`key`), and picks its token by
    the Gumbel-max race keyed by (key, token id) (`gumbel_race.py`): the same seed gives the
    same tokens whether the logits came from a cold prompt or a prefix-cache hit, alone or
    batched, on one rank or split, unless two candidates' perturbed scores lie within the
    logits' difference.

    Args:
        params: resolved sampling settings.
        device: where the logits live (the generator must be on the same device).
    """

    __slots__ = ("_generator", "_pending", "params", "seed")

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(self.seed)
        # Keys drawn ahead (`key`) and not yet used by a draw, in draw order.
        self._pending: deque[int] = deque()

    def key(self, ahead: int = 0) -> int:
        """The key (63 bits) that the draw `ahead` draws after the next one uses (0: the
        next draw's): drawn from the request's generator once, in order, and kept until a
        draw uses it (`_take`, `forwarded`). Handing keys to another process for a step
        whose rows are then skipped (the request pre-empted) or only partly used (a
        speculative draft cut at a rejection: `last_rank_sampling.py`) leaves the sequence
        of draws as it would have been.

        Args:
            ahead: how many draws come before the one this key is for (>= 0).
        """
        while len(self._pending) <= ahead:
            self._pending.append(draw_key(self._generator))
        return self._pending[ahead]

    def forwarded(self) -> None:
        """Another process drew this step's token with `key()` (when not greedy): that key
        is used up, the keys drawn ahead of it stay for the next draws."""
        if not self.params.is_greedy:
            self._take()

    def _take(self) -> int:
        """The next draw's key, used up (drawn first where it was not yet)."""
        key = self.key()
        self._pending.popleft()
        return key

    def skip_draw(self) -> None:
        """Use up the key one step's draw takes, for a token that was not drawn here (a
        forced token, `RequestState.force`): a seeded request then draws its next tokens
        with the keys the unbroken run would have used (a constrained draw takes one key
        too, however many tokens it rejects)."""
        if not self.params.is_greedy:
            self._take()

    def sample(self, logits: torch.Tensor, constraint: TokenFilter | None = None) -> int:
        """Pick the next token.

        Under a constraint the token is chosen first and checked: greedy takes the argmax,
        sampling the winner of the race (`gumbel_race.py`); a rejected token is dropped and
        the next best taken (for sampling: the next best perturbed score of the same race,
        so the result is the race's winner among the allowed tokens, a draw from the
        distribution restricted to them, and a seed gives the same tokens as unconstrained
        sampling wherever the winner is allowed). After `MAX_REJECTIONS` rejections
        (greedy: after also checking the `SCAN_BLOCK` most likely tokens in order) the
        whole allowed set is computed and the choice made among it. If the filters
        (top-k/top-p/min-p) left no allowed token, the most likely allowed token of the
        unfiltered scores is taken.

        Args:
            logits: `[vocab]` scores of the last position (penalties already applied).
            constraint: which tokens may be drawn; None allows every token.

        Returns:
            The token id.

        Raises:
            NoAllowedTokenError: the constraint allows no token.
        """
        if constraint is None:
            if self.params.is_greedy:
                return argmax_token(logits)
            return sample_unconstrained(logits, self.params, self._take())
        if self.params.is_greedy:
            return self._constrained_greedy(logits, constraint)
        return self._constrained_sample(logits, constraint)

    def draw(self, probs: torch.Tensor) -> int:
        """An index drawn with probabilities `probs` `[n]` (need not sum to 1) by the race
        with the next key (the general speculative acceptance rule's residual and bonus
        draws, `RequestState.accept_drafts`)."""
        return race_probabilities(probs, self._take())

    def next_uniform(self) -> float:
        """A uniform number in [0, 1) from the next key, used up (the general acceptance
        rule's test of a draft token; `gumbel_race.key_uniform`)."""
        return key_uniform(self._take())

    def distribution(self, logits: torch.Tensor, constraint: TokenFilter | None) -> torch.Tensor:
        """The distribution `sample` draws from (temperature > 0): the filters' candidates
        (`sampling_candidates`) softmaxed, restricted to the tokens `constraint` allows and
        renormalised; where the filters left no allowed token, all the mass on the token
        `sample` falls back to (the likeliest allowed one of the unfiltered scores).

        Args:
            logits: `[vocab]` scores (penalties and bias applied).

        Returns:
            `[vocab]` float64 probabilities summing to 1.

        Raises:
            NoAllowedTokenError: the constraint allows no token.
        """
        ids, kept = sampling_candidates(logits, self.params)
        probs = torch.softmax(kept, dim=-1).double()
        if ids is not None:
            full = torch.zeros(logits.shape[-1], dtype=torch.float64, device=probs.device)
            probs = full.index_copy_(0, ids, probs)
        if constraint is None:
            return probs
        allowed = constraint.allowed_tokens()
        if allowed:
            allowed_ids = torch.tensor(allowed, dtype=torch.long, device=probs.device)
            restricted = torch.zeros_like(probs).index_copy_(
                0, allowed_ids, probs.index_select(0, allowed_ids)
            )
            total = float(restricted.sum())
            if total > 0.0:
                return restricted / total
        fallback = torch.zeros_like(probs)
        fallback[_best_allowed(logits, allowed)] = 1.0
        return fallback

    def _constrained_greedy(self, logits: torch.Tensor, constraint: TokenFilter) -> int:
        scores = logits.float().clone()  # [vocab]
        for _attempt in range(MAX_REJECTIONS):
            token = argmax_token(scores)
            if constraint.allowed(token):
                return token
            scores[token] = float("-inf")
        block = min(SCAN_BLOCK, scores.shape[-1])
        for token in torch.topk(scores, block).indices.tolist():
            if constraint.allowed(token):
                return token
        return _best_allowed(logits, constraint.allowed_tokens())

    def _constrained_sample(self, logits: torch.Tensor, constraint: TokenFilter) -> int:
        # The race's perturbed scores over the filters' candidates, best first: the argmax
        # of Gumbel-perturbed scores over any subset of the tokens is a draw from the
        # distribution restricted to that subset, so dropping rejected tokens and taking
        # the next best draws from the allowed tokens, with one key however many are
        # rejected.
        ids, kept = sampling_candidates(logits, self.params)
        perturbed = gumbel_scores(kept, ids, self._take())  # [candidates]
        for _attempt in range(MAX_REJECTIONS):
            index = race_winner(perturbed)
            if perturbed[index] == float("-inf"):  # every candidate left was rejected
                break
            token = index if ids is None else int(ids[index])
            if constraint.allowed(token):
                return token
            perturbed[index] = float("-inf")
        allowed = constraint.allowed_tokens()
        if allowed:
            allowed_ids = torch.tensor(allowed, dtype=torch.long, device=perturbed.device)
            keep = (
                torch.zeros_like(perturbed, dtype=torch.bool).index_fill_(0, allowed_ids, True)
                if ids is None
                else torch.isin(ids, allowed_ids)
            )
            restricted = torch.where(keep, perturbed, float("-inf"))  # the allowed candidates
            index = race_winner(restricted)
            if restricted[index] > float("-inf"):
                return index if ids is None else int(ids[index])
        return _best_allowed(logits, allowed)


def _best_allowed(logits: torch.Tensor, allowed: list[int]) -> int:
    """The highest-scoring token of `allowed` under `[vocab]` `logits`.

    Raises:
        NoAllowedTokenError: `allowed` is empty.
    """
    if not allowed:
        raise NoAllowedTokenError("the constraint allows no token of the vocabulary")
    ids = torch.tensor(allowed, dtype=torch.long, device=logits.device)
    return allowed[int(torch.argmax(logits[ids]).item())]


@dataclass(frozen=True, slots=True)
class StepLogprobs:
    """Log probabilities at one position (natural log, clamped to >= `MIN_LOGPROB`).

    `top_ids`/`top_logprobs` are the most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A token chosen from a step's logits by another process (a pipeline's last rank, from
    the request's sampling settings and `Sampler.key`), in place of the logits: the
    token and, when the request asked for them, its logprobs (`step_logprobs`)."""

    token_id: int
    logprobs: StepLogprobs | None = None


def step_logprobs(logits: torch.Tensor, token_id: int, top_n: int) -> StepLogprobs:
    """Log probabilities of the model's distribution (raw logits: before penalties, filters
    and constraints, as OpenAI and vLLM report them).

    Args:
        logits: `[vocab]` raw scores of the position.
        token_id: the token that was chosen.
        top_n: how many of the most likely tokens to report (0: none).

    Returns:
        The chosen token's log probability and the `top_n` most likely tokens'.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
    logprob = max(float(log_probs[token_id].item()), MIN_LOGPROB)
    if top_n <= 0:
        return StepLogprobs(token_id, logprob, (), ())
    top = torch.topk(log_probs, min(top_n, log_probs.shape[-1]))  # sorted, descending
    values = tuple(max(value, MIN_LOGPROB) for value in top.values.tolist())
    return StepLogprobs(token_id, logprob, tuple(top.indices.tolist()), values)


class TokenChooser:
    """Turns one request's logits into tokens: penalties, then the logit bias, then the
    (constrained) sampler.

    Args:
        sampler: draws the token.
        penalties: the request's penalty state, or None when it has none.
        constraint: restricts which tokens may follow (JSON, a tool call), or None.
        bias: the request's logit bias, or None when it has none.
    """

    __slots__ = ("bias", "constraint", "penalties", "sampler")

    def __init__(
        self,
        sampler: Sampler,
        penalties: TokenPenalties | None = None,
        constraint: OutputConstraint | None = None,
        bias: LogitBias | None = None,
    ) -> None:
        self.sampler = sampler
        self.penalties = penalties
        self.constraint = constraint
        self.bias = bias

    @property
    def needs_logits(self) -> bool:
        """Whether choosing needs this process to see the logits (penalties, bias,
        constraint); otherwise a pipeline's last rank may sample on its own."""
        return self.penalties is not None or self.constraint is not None or self.bias is not None

    @property
    def is_complete(self) -> bool:
        """The constraint's document is complete (generation must stop)."""
        return self.constraint is not None and self.constraint.is_complete

    def choose(self, logits: torch.Tensor | SampledToken) -> int:
        """Pick the next token.

        Args:
            logits: `[vocab]` raw scores of the last position, or the token a pipeline's
                last rank chose (only for a chooser without penalties, bias or constraint).

        Returns:
            The token id.

        Raises:
            NoAllowedTokenError: the constraint allows no token.
        """
        if isinstance(logits, SampledToken):
            assert not self.needs_logits, "a token chosen elsewhere skipped this chooser's rules"
            assert logits.token_id >= 0, "a row another rank skipped was taken as chosen"
            self.sampler.forwarded()
            return logits.token_id
        scores = logits if self.penalties is None else self.penalties.apply(logits)
        if self.bias is not None:
            scores = self.bias.apply(scores)
        return self.sampler.sample(scores, self.constraint)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """`[vocab]` float64: the distribution `choose` draws the next token from (a
        sampling request: penalties, bias, filters and constraint as `choose` applies
        them; `Sampler.distribution`).

        Raises:
            NoAllowedTokenError: the constraint allows no token.
        """
        scores = logits if self.penalties is None else self.penalties.apply(logits)
        if self.bias is not None:
            scores = self.bias.apply(scores)
        return self.sampler.distribution(scores, self.constraint)

    def observe(self, token_id: int) -> None:
        """Record the chosen token (penalty counts, constraint state)."""
        if self.penalties is not None:
            self.penalties.observe(token_id)
        if self.constraint is not None:
            self.constraint.advance(token_id)
