"""Grouping of a fast stream's token chunks (`exo --stream-interval-ms`).

Each chunk a runner streams costs the node a pipe message, an event-loop wake-up and a
response write, on the cores that decode. When decode steps are shorter than the stream
interval, a command's token chunks are held and leave merged (texts, token ids and
logprobs in order): at ~150 tok/s and 30 ms, four or five tokens per chunk. The first
chunk (it carries the prompt's size: TTFT) and the last never wait. SGLang's
`--stream-interval` groups tokens the same way, by count."""

from __future__ import annotations

import time
from collections.abc import Callable

from exo.shared.types.chunks import TokenChunk, merged_token_chunks
from exo.shared.types.common import CommandId


class ChunkGrouper:
    """Holds back token chunks per command and hands the ones that leave to `send`.

    Args:
        interval_s: the stream interval in seconds (0: every chunk leaves at once).
        send: called with each chunk that leaves, in order per command.
    """

    def __init__(self, interval_s: float, send: Callable[[TokenChunk], None]) -> None:
        self._interval = interval_s
        self._send = send
        # Per command, the chunks held (merged into one when they leave: one copy).
        self._held: dict[CommandId, list[TokenChunk]] = {}
        self._streamed_at: dict[CommandId, float] = {}

    @property
    def idle(self) -> bool:
        """Whether no command has a chunk held or a send time kept (every stream ended)."""
        return not self._held and not self._streamed_at

    def token_chunk(self, chunk: TokenChunk, may_hold: bool, last_step_s: float) -> None:
        """Stream `chunk` (after any chunk held for its command, merged into one), or hold it
        to leave with the command's next one: when `may_hold`, the command's last chunk left
        less than the interval ago, the last step took less than the interval (`last_step_s`,
        so the next chunk comes soon) and `chunk` is neither the first (`prompt_tokens` set)
        nor the last (`finish_reason` set)."""
        now = time.monotonic()
        held = self._held.get(chunk.command_id)
        if (
            may_hold
            and chunk.finish_reason is None
            and chunk.prompt_tokens is None  # (so is every held chunk's)
            and last_step_s < self._interval
            and now - self._streamed_at.get(chunk.command_id, float("-inf")) < self._interval
        ):
            if held is None:
                self._held[chunk.command_id] = [chunk]
            else:
                held.append(chunk)
            return
        if held is not None:
            del self._held[chunk.command_id]
            chunk = merged_token_chunks(*held, chunk)
        self._streamed_at[chunk.command_id] = now
        if chunk.finish_reason is not None:
            del self._streamed_at[chunk.command_id]
        self._send(chunk)

    def release(self, command_id: CommandId) -> None:
        """Send the chunk held for `command_id`, if any (before its stream's end, an error,
        or a chunk of another kind)."""
        held = self._held.pop(command_id, None)
        if held is not None:
            self._streamed_at[command_id] = time.monotonic()
            self._send(merged_token_chunks(*held))

    def forget(self, command_id: CommandId) -> None:
        """A stream ends: what it held leaves, its send time is dropped."""
        self.release(command_id)
        self._streamed_at.pop(command_id, None)
