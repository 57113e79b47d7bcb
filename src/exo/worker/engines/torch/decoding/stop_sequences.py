"""Stop strings over a stream of text pieces.

A stop string may be split across tokens ("<|en" + "d|>"), so text that could be the start of
a stop string is held back until the next piece decides it. The stop string itself is never
emitted; text before it (even in the same piece) is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopCheck:
    """Result of feeding one piece: `text` is safe to emit now; `stopped` means a stop string
    was found (and `text` is everything before it that had not been emitted yet)."""

    text: str
    stopped: bool
    stop: str | None = None
    """The stop string found, when `stopped`."""


class StopSequenceMatcher:
    """Finds the first occurrence of any stop string in the concatenation of fed pieces.

    Args:
        stop_sequences: the stop strings; empty strings are ignored.
    """

    __slots__ = ("_held", "_stopped", "_stops")

    def __init__(self, stop_sequences: Sequence[str]) -> None:
        self._stops = tuple(sorted({stop for stop in stop_sequences if stop}, key=len))
        self._held = ""
        self._stopped = False

    @property
    def held_text(self) -> str:
        """Text withheld because it may be the start of a stop string."""
        return self._held

    def feed(self, piece: str) -> StopCheck:
        """Add the next piece of generated text.

        Returns:
            What may be emitted now and whether generation must stop.
        """
        if self._stopped:
            raise RuntimeError("feed() after a stop string was found")
        if not self._stops:
            return StopCheck(piece, False)
        buffer = self._held + piece
        found = self._first_stop(buffer)
        if found is not None:
            stop_index, stop = found
            self._held = ""
            self._stopped = True
            return StopCheck(buffer[:stop_index], True, stop)
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return StopCheck(buffer[: len(buffer) - keep], False)

    def flush(self) -> str:
        """Release the held-back text when generation ends without a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in `buffer` (at equal indexes the
        shortest, which is the one that completed first)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = buffer.find(stop)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
