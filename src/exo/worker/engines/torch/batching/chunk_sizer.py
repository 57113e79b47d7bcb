"""How many prompt tokens a step prefills beside running decodes, from measured step times.

A step that carries a prompt chunk beside the decode rows delays every running stream's next
token by the chunk's cost. A fixed chunk (8 tokens, chosen once) was right for one machine
and one kernel set; when decode steps got faster the same chunk tripled the running streams'
gaps, and on a fast machine it prefills a long prompt needlessly slowly. So the chunk is
sized from what steps cost here and now. The scheduler reports each step's forward-pass
time with its decode rows and prompt tokens (`observe`); the sizer models a step's time as

    step_seconds(D, chunk) = decode_seconds(D) + fixed_seconds + chunk * token_seconds

and `chunk` returns the most prompt tokens whose predicted step time stays within
`gap_ratio` times a decode-only step with as many decode rows:

    chunk = floor(((gap_ratio - 1) * decode_seconds(D) - fixed_seconds) / token_seconds)

at least one token (a prompt beside streams always advances), at most `maximum`, and at most
double the previous chunk. This is the rule that brings the joining prompt's TTFT as close
to its alone TTFT as the gap target allows: a step's time grows with its chunk, so the
largest chunk within the gap bound prefills the prompt in the fewest steps of bounded gap.

`decode_seconds(D)` is an exponential moving average of decode-only steps with D decode
rows (the nearest measured D where this one has none). `fixed_seconds` and `token_seconds`
are the intercept and slope of a least-squares line through the last `COST_WINDOW` chunk
steps' (prompt tokens, time beyond the decode-only time): a chunk step has costs that do
not grow with its chunk (the chunk's attention setup per layer), and the per-token cost
rises with the prompt's position (its attention over the prompt so far), which a recent
window follows. The rule before this one charged every second of a chunk step to its
tokens (an averaged cost per token). It settles on the same chunk where costs are linear,
but only after a series of steps that each over- or undershoot, through the average's lag.
The fitted line predicts it from two chunk sizes. Where the window's chunks are all one
size (no slope to fit), or the fit has a negative intercept (costs not linear in the
chunk), the time is charged to the tokens, as before. Until both costs are measured
the chunk is `initial`; where no decode-only step has been measured yet (a prompt arrived
as the first stream began), the first call returns 0: one step without prompt tokens, to
measure the decode rows alone. This is Sarathi-Serve's token budget per step (Agrawal et al.
2024), set from a latency target instead of a constant; figures:
docs/benchmarks/2026-12-05-mixed-steps.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# The running streams' gap target while a prompt is prefilled beside them is 3x their idle
# gap (issue 40); a step's forward pass is aimed at 2.5x a decode-only one, leaving room for
# measurement noise and the per-step work outside the forward pass.
DEFAULT_GAP_RATIO = 2.5
# The chunk before any step has been measured (the old fixed chunk).
DEFAULT_INITIAL_CHUNK = 8
# Weight of the newest measurement in the decode-only moving averages.
SMOOTHING = 0.25
# Chunk steps the fixed and per-token costs are fitted over (recent ones: the per-token
# cost grows with the prompt's position).
COST_WINDOW = 12


@dataclass(slots=True)
class PrefillChunkSizer:
    """Prompt tokens per step beside decode rows (see the module docstring).

    Args:
        maximum: the largest chunk (tokens), e.g. the idle prefill chunk.
        gap_ratio: the step time allowed, as a multiple of a decode-only step's (> 1).
        initial: the chunk until both costs have been measured (tokens).
    """

    maximum: int
    gap_ratio: float = DEFAULT_GAP_RATIO
    initial: int = DEFAULT_INITIAL_CHUNK
    _decode_seconds: dict[int, float] = field(default_factory=dict)
    # (prompt tokens, seconds beyond the decode-only step) of recent chunk steps.
    _chunk_steps: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=COST_WINDOW)
    )
    _last_chunk: int = 0
    _probed: bool = False

    def __post_init__(self) -> None:
        if self.maximum < 1 or self.initial < 1:
            raise ValueError("maximum and initial must be at least one token")
        if self.gap_ratio <= 1.0:
            raise ValueError("gap_ratio must be above 1")

    def decode_seconds(self, decode_rows: int) -> float | None:
        """The averaged time of a decode-only step with `decode_rows` rows (seconds), or the
        nearest measured row count's; None before any decode-only step was measured."""
        if not self._decode_seconds:
            return None
        nearest = min(self._decode_seconds, key=lambda rows: (abs(rows - decode_rows), rows))
        return self._decode_seconds[nearest]

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """Record one step's forward-pass time (seconds) with its decode rows and prompt
        tokens. Steps without decode rows are not used (no stream waits on them)."""
        if decode_rows <= 0 or seconds <= 0.0:
            return
        if prompt_tokens <= 0:
            previous = self._decode_seconds.get(decode_rows)
            self._decode_seconds[decode_rows] = (
                seconds if previous is None else previous + SMOOTHING * (seconds - previous)
            )
            return
        base = self.decode_seconds(decode_rows)
        if base is None:
            return
        self._chunk_steps.append((prompt_tokens, max(seconds - base, 0.0)))

    def costs(self) -> tuple[float, float] | None:
        """`(fixed_seconds, token_seconds)` of a chunk step beyond its decode rows, fitted
        over the recent chunk steps (see the module docstring); None before any."""
        steps = self._chunk_steps
        if not steps:
            return None
        count = len(steps)
        mean_tokens = sum(tokens for tokens, _ in steps) / count
        mean_seconds = sum(seconds for _, seconds in steps) / count
        spread = sum((tokens - mean_tokens) ** 2 for tokens, _ in steps)
        if spread > 0.0:
            slope = (
                sum((tokens - mean_tokens) * (seconds - mean_seconds) for tokens, seconds in steps)
                / spread
            )
            fixed = mean_seconds - slope * mean_tokens
            if slope > 0.0 and fixed >= 0.0:
                return fixed, slope
        # One chunk size, or a fit outside the model (noise): every second to the tokens.
        return 0.0, mean_seconds / mean_tokens

    def chunk(self, decode_rows: int) -> int:
        """Prompt tokens for the next step beside `decode_rows` decode rows (1..maximum), or
        0 once while no decode-only step has been measured (a step to measure one)."""
        base = self.decode_seconds(decode_rows)
        if base is None and decode_rows > 0 and not self._probed:
            self._probed = True
            return 0
        costs = self.costs()
        if base is None or costs is None:
            size = self.initial
        elif costs[1] <= 0.0:
            size = self.maximum
        else:
            fixed, per_token = costs
            # (the tiny factor keeps a whole quotient whole through float rounding)
            size = int(((self.gap_ratio - 1.0) * base - fixed) / per_token * (1.0 + 1e-9))
        if self._last_chunk:
            size = min(size, 2 * self._last_chunk)
        size = max(1, min(size, self.maximum))
        self._last_chunk = size
        return size


@dataclass(slots=True)
class FixedChunkSizer:
    """A prompt chunk of `tokens` per step whatever the steps cost: `PrefillChunkSizer`'s
    interface for A/B benchmarks and for tests whose steps must not depend on the
    machine's speed (the measured sizer picks chunks from wall-clock step times)."""

    tokens: int

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """Nothing to learn: the chunk is fixed."""

    def chunk(self, decode_rows: int) -> int:
        """`tokens`, for any number of decode rows."""
        return self.tokens
