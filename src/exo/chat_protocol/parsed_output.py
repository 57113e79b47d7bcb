"""What the output parsers release per piece, and the marker search they share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from exo.shared.types.text_generation import ToolCall


@dataclass(slots=True)
class ParsedOutput:
    """What one `feed`/`finish` call releases: answer text and reasoning text to stream
    now, and the tool calls completed by this piece (in order)."""

    text: str = ""
    reasoning_text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def is_empty(self) -> bool:
        """True when this piece releases nothing."""
        return not (self.text or self.reasoning_text or self.tool_calls)


def partial_marker_length(buffer: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `buffer` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(buffer)), longest, -1):
            if buffer.endswith(marker[:length]):
                longest = length
                break
    return longest


def find_first(buffer: str, markers: Sequence[str], start: int = 0) -> tuple[int, str]:
    """Index and text of the earliest marker in `buffer[start:]`; (-1, "") if none."""
    best_index, best_marker = -1, ""
    for marker in markers:
        index = buffer.find(marker, start)
        if index != -1 and (best_index == -1 or index < best_index):
            best_index, best_marker = index, marker
    return best_index, best_marker
