"""How many prompt tokens a step prefills beside running decodes, from measured step times.

A step that carries a prompt chunk beside the decode rows delays every running stream's next
token by the chunk's cost. A fixed chunk (8 tokens, chosen once) was right for one machine
and one kernel set; when decode steps got faster the same chunk tripled the running streams'
gaps, and on a fast machine it prefills a long prompt needlessly slowly. So the chunk is
sized from what steps cost here and now: the scheduler reports each step's forward-pass
time with its decode rows and prompt tokens (`observe`), and `chunk` returns the most
prompt tokens whose predicted step time stays within `gap_ratio` times a decode-only step
with as many decode rows:

    decode_seconds(D) + chunk * token_seconds <= gap_ratio * decode_seconds(D)

`decode_seconds(D)` is an exponential moving average of decode-only steps with D decode
rows (the nearest measured D where this one has none); `token_seconds` one of a chunk
step's time beyond the decode-only time, per prompt token. The per-token cost falls as
chunks grow (fewer, larger matrix products) and rises with the prompt's position (its
attention), so the size follows the measurements: it may at most double from one step to
the next, and until both costs are measured it is `initial`. Where no decode-only step has
been measured yet (a prompt arrived as the first stream began), the first call returns 0:
one step without prompt tokens, to measure the decode rows alone. This is Sarathi-Serve's token
budget per step (Agrawal et al. 2024), set from a latency target instead of a constant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The running streams' gap target while a prompt is prefilled beside them is 3x their idle
# gap (issue 40); a step's forward pass is aimed at 2.5x a decode-only one, leaving room for
# measurement noise and the per-step work outside the forward pass.
DEFAULT_GAP_RATIO = 2.5
# The chunk before any step has been measured (the old fixed chunk).
DEFAULT_INITIAL_CHUNK = 8
# Weight of the newest measurement in the moving averages.
SMOOTHING = 0.25


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
    _token_seconds: float | None = None
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
        per_token = max(seconds - base, 0.0) / prompt_tokens
        previous_token = self._token_seconds
        self._token_seconds = (
            per_token
            if previous_token is None
            else previous_token + SMOOTHING * (per_token - previous_token)
        )

    def chunk(self, decode_rows: int) -> int:
        """Prompt tokens for the next step beside `decode_rows` decode rows (1..maximum), or
        0 once while no decode-only step has been measured (a step to measure one)."""
        base = self.decode_seconds(decode_rows)
        if base is None and decode_rows > 0 and not self._probed:
            self._probed = True
            return 0
        if base is None or self._token_seconds is None:
            size = self.initial
        elif self._token_seconds <= 0.0:
            size = self.maximum
        else:
            # (the tiny factor keeps a whole quotient whole through float rounding)
            size = int((self.gap_ratio - 1.0) * base / self._token_seconds * (1.0 + 1e-9))
        if self._last_chunk:
            size = min(size, 2 * self._last_chunk)
        size = max(1, min(size, self.maximum))
        self._last_chunk = size
        return size
