"""In-process publish/subscribe topics on anyio memory streams.

A `Topic` fans every published item out to all of its current subscribers. The router
of a node owns one `Topic` per message kind; components only see the sender and
receiver ends handed to their constructors, so the transport can change (zenoh between
nodes) without touching them.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

T = TypeVar("T")


class Topic(Generic[T]):
    """Broadcast of items of type `T` to every subscriber, in publication order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._subscribers: list[MemoryObjectSendStream[T]] = []

    def publish(self, item: T) -> None:
        """Deliver `item` to every live subscriber; never blocks (unbounded buffers)."""
        alive: list[MemoryObjectSendStream[T]] = []
        for subscriber in self._subscribers:
            try:
                subscriber.send_nowait(item)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                continue
            alive.append(subscriber)
        self._subscribers = alive

    def subscribe(self) -> Subscription[T]:
        send, receive = anyio.create_memory_object_stream[T](max_buffer_size=math.inf)
        self._subscribers.append(send)
        return Subscription(receive)

    def sender(self) -> Publisher[T]:
        return Publisher(self)


class Publisher(Generic[T]):
    """The sending end of a topic handed to a component."""

    def __init__(self, topic: Topic[T]) -> None:
        self._topic = topic

    def publish(self, item: T) -> None:
        self._topic.publish(item)


class Subscription(Generic[T]):
    """The receiving end of a topic handed to a component."""

    def __init__(self, stream: MemoryObjectReceiveStream[T]) -> None:
        self._stream = stream

    async def receive(self) -> T:
        return await self._stream.receive()

    def receive_nowait(self) -> T:
        return self._stream.receive_nowait()

    def close(self) -> None:
        self._stream.close()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._stream.__aiter__()
