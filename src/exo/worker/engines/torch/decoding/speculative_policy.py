"""When a request speculates and how far: the node's settings, the per-request draft length,
the per-instance automatic switch, and the counters `/metrics` and `/state` report.

A request asks with its `speculative` field: True always drafts (where a draft is found,
at its adaptive length), False never, "auto" (or None: the node's default, `--speculative`)
follows the instance's `AutoSwitch`, which compares measured throughput with and without
drafts, and its drafts are cut to the length that pays for its rows (`best_draft_length`).
Each draft row costs step time whether or not it is accepted: on a 4-core CPU a 0.8B draft
model made a 4B target 1.48x slower (issue 43), and on a 2-core CPU a step of the default
model over 7 rows took about 4x one over a single row (docs/benchmarks/
2026-12-06-speculative.md), so speculation must be on only where it is measured to help.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from exo.shared.types.text_generation import (
    DEFAULT_DRAFT_MAX,
    DEFAULT_DRAFT_MIN,
    SpeculativeMode,
)

# The draft length's steps (Hugging Face transformers' assisted generation's heuristic for
# `num_assistant_tokens`: +2 after a round whose draft was all accepted, -1 otherwise).
GROW_ON_FULL_ACCEPT = 2
SHRINK_ON_REJECT = 1


@dataclass(frozen=True, slots=True)
class SpeculationSettings:
    """A node's speculative-decoding settings (`--speculative`, `--draft-min`,
    `--draft-max`).

    Attributes:
        default: what a request without a `speculative` field does.
        draft_min: drafts shorter than this are not verified (as llama-server's
            `--draft-min`); also the adaptive length's floor.
        draft_max: the adaptive length's ceiling (tokens per request per step).

    Raises:
        ValueError: bounds below 1 or out of order.
    """

    default: SpeculativeMode = "auto"
    draft_min: int = DEFAULT_DRAFT_MIN
    draft_max: int = DEFAULT_DRAFT_MAX

    def __post_init__(self) -> None:
        if not 1 <= self.draft_min <= self.draft_max:
            raise ValueError(
                f"draft length bounds {self.draft_min}..{self.draft_max}: need 1 <= min <= max"
            )

    def mode_of(self, requested: SpeculativeMode | None) -> SpeculativeMode:
        """A request's mode: its own, else the node's default."""
        return self.default if requested is None else requested


# Weight kept of the earlier rounds in a request's acceptance estimate, per round.
ACCEPTANCE_DECAY = 0.9


@dataclass(slots=True)
class DraftLength:
    """One request's adaptive draft length within `[minimum, maximum]`: longer after a round
    whose every draft token was accepted, shorter after a rejection; and its estimated
    per-token acceptance probability (`acceptance`)."""

    minimum: int
    maximum: int
    current: int = 0
    # Decayed counts of accepted draft tokens and of rejected ones (at most one per round:
    # verification stops at the first), over the request's rounds.
    _accepted: float = 0.0
    _rejected: float = 0.0

    def __post_init__(self) -> None:
        if self.current == 0:
            self.current = self.maximum

    @property
    def acceptance(self) -> float | None:
        """The probability that a draft token is accepted, estimated as accepted over
        verified tokens (the maximum-likelihood estimate of a geometric run's success
        probability); None before any round."""
        verified = self._accepted + self._rejected
        return self._accepted / verified if verified > 0 else None

    def update(self, drafted: int, accepted: int) -> None:
        """After a verified round of `drafted` tokens of which `accepted` were taken."""
        if drafted <= 0:
            return
        self._accepted = ACCEPTANCE_DECAY * self._accepted + accepted
        self._rejected = ACCEPTANCE_DECAY * self._rejected + (1 if accepted < drafted else 0)
        if accepted >= drafted:
            self.current = min(self.maximum, self.current + GROW_ON_FULL_ACCEPT)
        else:
            self.current = max(self.minimum, self.current - SHRINK_ON_REJECT)


def expected_tokens(acceptance: float, draft: int) -> float:
    """Tokens a round with a draft of `draft` tokens emits on average, each draft token
    accepted with probability `acceptance` independently until the first rejection, plus
    the correction or bonus token: (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023, eq. 1)."""
    if acceptance >= 1.0:
        return draft + 1.0
    return (1.0 - acceptance ** (draft + 1)) / (1.0 - acceptance)


def best_draft_length(
    acceptance: float, limit: int, plain_rows: int, step_seconds: Callable[[int], float | None]
) -> int:
    """The draft length in `0 .. limit` with the most expected tokens per second of step
    time: `expected_tokens(acceptance, k) / t(plain_rows + k)`, t a decode-only step's
    measured time by its rows (`AutoSwitch.step_seconds`, the nearest measured row count's
    for one not measured yet: such a length is tried and so measured). On a CPU a step's
    time grows with its rows (each row's products and attention), so a long draft of
    uncertain tokens can cost more than it brings. `limit` where nothing is measured."""
    best, best_rate = limit, 0.0
    for draft in range(limit + 1):
        seconds = step_seconds(plain_rows + draft)
        if seconds is None or seconds <= 0.0:
            return limit
        rate = expected_tokens(acceptance, draft) / seconds
        if rate > best_rate:
            best, best_rate = draft, rate
    return best


# Weight of the newest measurement in the switch's moving averages.
SWITCH_SMOOTHING = 0.2
# Speculation turns off when drafting measured below this gain, on again above the other
# (a band, so measurement noise does not flip it every few steps).
SWITCH_OFF_BELOW = 0.98
SWITCH_ON_ABOVE = 1.02
# Every this many decode steps, drafts are tried for the last `PROBE_STEPS` of them, uncapped
# (the text may have turned into a copy; the machine's load may have changed). While off, a
# probe that leaves it off doubles the interval, up to `PROBE_INTERVAL_MAX`: a draft that
# never helps costs at most PROBE_STEPS of every PROBE_INTERVAL_MAX steps.
PROBE_INTERVAL = 64
PROBE_INTERVAL_MAX = 1024
PROBE_STEPS = 6


@dataclass(slots=True)
class AutoSwitch:
    """Per instance: whether requests in "auto" mode draft now.

    A decode-only step's time is, on a CPU, a function of its row count (weights read once,
    plus a cost per row). The switch keeps the moving average of that time per row count,
    the plain one (`n` rows for `n` requests) from forward passes alone, and for each step
    that drafted (draft rows, or a draft source asked: a draft model's passes and its
    prompt catch-up, which yield no draft rows while it catches up) the gain

        gain = (tokens emitted / (t(rows) + drafting seconds)) / (requests / t(requests))

    the tokens per second of that step over those of a plain step of the same requests
    (t(n): the averaged time of a decode-only step of n rows, the nearest measured n where
    none of n was; a step with draft rows is averaged with its drafting time in). It is on
    while the gain's moving average is above the band, off below it; while off it probes
    now and then (`PROBE_INTERVAL`, backing off to `PROBE_INTERVAL_MAX`; a probe step that
    loses ends its probe). On at start: a
    request with no draft found costs nothing, so the first drafts measure their own worth;
    but never without a plain step to compare with: where the requests' plain step time
    was not measured in the last `PROBE_INTERVAL` steps, one step is kept plain (a
    reference step, at most one per interval). So a draft whose tokens are never accepted,
    or which costs more than it saves, turns the switch off at its first drafting step
    after a reference (later, the more a good past has lifted the gain: each such step
    takes a fifth of the way from the average down to its gain). Its probes also lift the
    cost cap on draft lengths (`best_draft_length`), which would otherwise never measure
    again a row count it had judged too dear.
    """

    enabled: bool = True
    gain: float | None = None
    # The last `allows` fell in a probe: drafts at their adaptive lengths, uncapped by the
    # measured costs, so every row count's time is measured again (on or off).
    probing: bool = False
    _step_seconds: dict[int, float] = field(default_factory=dict)
    # `allows` calls since the start or since the switch turned off (probes' phase).
    _steps: int = 0
    _interval: int = PROBE_INTERVAL
    # `allows` calls in all, and at which one each request count's plain step time was last
    # measured and the last reference step was asked for.
    _asked: int = 0
    _plain_at: dict[int, int] = field(default_factory=dict)
    _reference_at: int | None = None

    def allows(self, requests: int) -> bool:
        """Whether "auto" requests draft this step of `requests` decoding requests: not in
        a reference step (see the class), else while on, and in probes (the last
        `PROBE_STEPS` of every probe interval) while off."""
        asked, self._asked = self._asked, self._asked + 1
        phase, self._steps = self._steps, self._steps + 1
        probe_from = self._interval - PROBE_STEPS
        self.probing = phase % self._interval >= probe_from
        if not self.enabled and phase >= self._interval and phase % self._interval == 0:
            # A probe ended with the switch still off: probe less often.
            self._interval = min(PROBE_INTERVAL_MAX, 2 * self._interval)
            self._steps = 1
            self.probing = False
        if self._needs_reference(requests, asked):
            self._reference_at = asked
            self.probing = False
            return False
        return self.enabled or self.probing

    def _needs_reference(self, requests: int, asked: int) -> bool:
        measured = self._plain_at.get(requests)
        if measured is not None and asked - measured < PROBE_INTERVAL:
            return False
        return self._reference_at is None or asked - self._reference_at >= PROBE_INTERVAL

    def step_seconds(self, rows: int) -> float | None:
        """The averaged time of a decode-only step of `rows` rows (or the nearest measured
        count's); None before any."""
        if not self._step_seconds:
            return None
        nearest = min(self._step_seconds, key=lambda measured: (abs(measured - rows), measured))
        return self._step_seconds[nearest]

    def observe(
        self, requests: int, rows: int, emitted: int, seconds: float, draft_seconds: float = 0.0
    ) -> None:
        """Record a decode-only step (no prompt rows) of `requests` requests laid out in
        `rows` rows (more than `requests` where some drafted) that emitted `emitted` tokens,
        its forward pass taking `seconds` and its drafts' proposal `draft_seconds` (0.0:
        no draft source was asked)."""
        if requests <= 0 or seconds <= 0.0:
            return
        drafted_rows = rows > requests
        measured = seconds + draft_seconds if drafted_rows else seconds
        previous = self._step_seconds.get(rows)
        self._step_seconds[rows] = (
            measured if previous is None else previous + SWITCH_SMOOTHING * (measured - previous)
        )
        if not drafted_rows:
            self._plain_at[requests] = self._asked
            if draft_seconds <= 0.0:
                return  # a plain step
        plain = self._step_seconds.get(requests)
        if plain is None:
            return  # no plain step of these requests measured yet
        # A step without draft rows is a plain step's forward (its averaged time, so its
        # noise does not count) plus what drafting cost.
        step = self._step_seconds[rows] if drafted_rows else plain + draft_seconds
        self._record_gain((emitted / step) / (requests / plain))

    def _record_gain(self, gain: float) -> None:
        if not self.enabled and self.probing and gain < SWITCH_OFF_BELOW:
            # A probe step that lost ends the probe: a draft model catching up on a new
            # prompt costs one step's chunk per probe, not PROBE_STEPS of them.
            self._steps = self._interval
        self.gain = gain if self.gain is None else self.gain + SWITCH_SMOOTHING * (gain - self.gain)
        if self.enabled and self.gain < SWITCH_OFF_BELOW:
            self.enabled = False
            self._steps = 0
        elif not self.enabled and self.gain > SWITCH_ON_ABOVE:
            self.enabled = True
            self._interval = PROBE_INTERVAL


@dataclass(slots=True)
class SpeculationCounters:
    """What speculation did on an instance, for `/metrics` and `/state`.

    Attributes:
        decode_rounds: (request, step) pairs in which a decoding request took part, with or
            without a draft.
        decode_tokens: tokens those rounds emitted.
        verify_rounds: the rounds that carried a draft.
        drafted_tokens: draft tokens verified.
        accepted_tokens: draft tokens accepted.
    """

    decode_rounds: int = 0
    decode_tokens: int = 0
    verify_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens; None before any draft."""
        if not self.drafted_tokens:
            return None
        return self.accepted_tokens / self.drafted_tokens

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens a decoding request gained per step, drafts or not (1 without
        speculation); None before any decode step."""
        if not self.decode_rounds:
            return None
        return self.decode_tokens / self.decode_rounds
