"""Test helpers for adapters: a scripted chunk stream."""

from __future__ import annotations

from collections.abc import Sequence

from exo.shared.types.chunks import Chunk


class ChunkSource:
    """An async chunk iterator over `chunks` that records how many were taken (adapters
    must stop reading at the first chunk with a finish reason)."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        self._chunks = list(chunks)
        self.taken = 0

    def __aiter__(self) -> ChunkSource:
        return self

    async def __anext__(self) -> Chunk:
        if self.taken >= len(self._chunks):
            raise StopAsyncIteration
        chunk = self._chunks[self.taken]
        self.taken += 1
        return chunk
