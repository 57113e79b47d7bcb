"""The supervisor reads its runner's pipe without blocking (`PipeFrames`): every message
the runner's `Connection.send_bytes` wrote comes back whole and in order, however the
bytes arrive (several messages in one read, one message over many reads, the long
framing's separate header write), and a closed pipe reads as closed."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

from exo.worker.runner.supervisor import PipeFrames, PipeWriter

SIZES = (0, 1, 10, 4095, 4096, 16384, 16385, 70_000, 300_000, 3, 2)


def _read_all(frames: PipeFrames, expected: int) -> tuple[list[bytes], bool]:
    messages: list[bytes] = []
    closed = False
    while not closed:
        batch, closed = frames.read()
        messages.extend(batch)
    assert len(messages) == expected
    return messages, closed


def test_every_message_comes_back_whole_and_in_order() -> None:
    read, write = Pipe(duplex=False)
    payloads = [bytes([index % 251]) * size for index, size in enumerate(SIZES)]

    def runner() -> None:  # larger than the pipe's buffer: written while being read
        for payload in payloads:
            write.send_bytes(payload)
        write.close()

    frames = PipeFrames(read.fileno())
    writer = threading.Thread(target=runner)
    writer.start()
    messages, closed = _read_all(frames, len(payloads))
    writer.join()
    assert messages == payloads
    assert closed
    read.close()


def test_nothing_waiting_reads_as_open_and_empty() -> None:
    read, write = Pipe(duplex=False)
    frames = PipeFrames(read.fileno())
    assert frames.read() == ([], False)
    write.send_bytes(b"[]")
    assert frames.read() == ([b"[]"], False)
    write.close()
    assert frames.read() == ([], True)
    read.close()


def test_a_message_split_across_reads_waits_for_its_end() -> None:
    read, write = Pipe(duplex=False)
    frames = PipeFrames(read.fileno())
    framed = (5).to_bytes(4, "big") + b"hello" + (3).to_bytes(4, "big") + b"abc"
    for cut in (2, 6, 9, 11):  # inside the header, the body, the next header, the next body
        write._send(framed[:cut])  # type: ignore[attr-defined]
        first, closed = frames.read()
        write._send(framed[cut:])  # type: ignore[attr-defined]
        second, _ = frames.read()
        assert first + second == [b"hello", b"abc"]
        assert not closed
    write.close()
    read.close()


# The other direction (`PipeWriter`): the node's tasks to a runner that is not reading.


def test_a_write_to_a_full_pipe_returns_at_once_and_arrives_whole_later() -> None:
    """The node's loop never blocks on a runner that is busy writing (the embedding
    deadlock): messages larger than the pipe's buffer wait in the writer while nobody
    reads, the loop keeps running, and a `recv_bytes` reader then gets every one whole
    and in order."""
    import asyncio
    import time

    read, write = Pipe(duplex=False)
    payloads = [bytes([index % 251]) * size for index, size in enumerate(SIZES)]
    received: list[bytes] = []
    waiting: list[int] = []

    async def node() -> None:
        writer = PipeWriter(write.fileno())
        for payload in payloads:
            writer.write(payload)  # a blocking write would never return: nobody reads
        waiting.append(writer.pending_bytes)
        reader = threading.Thread(
            target=lambda: received.extend(read.recv_bytes() for _ in payloads)
        )
        reader.start()
        deadline = time.monotonic() + 30
        while writer.pending_bytes and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the loop runs: `add_writer` drains the rest
        reader.join(timeout=30)

    loop_thread = threading.Thread(target=lambda: asyncio.run(node()), daemon=True)
    loop_thread.start()
    loop_thread.join(timeout=60)
    assert not loop_thread.is_alive(), "write() blocked on a full pipe"
    assert waiting and waiting[0] > 0, "the payloads were meant to overfill the pipe"
    assert received == payloads
    read.close()
    write.close()


def test_without_an_event_loop_a_write_finishes_blocking() -> None:
    read, write = Pipe(duplex=False)
    payload = b"x" * 300_000
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(read.recv_bytes()))
    reader.start()
    writer = PipeWriter(write.fileno())
    writer.write(payload)
    assert writer.pending_bytes == 0
    reader.join(timeout=30)
    assert received == [payload]
    writer.close()
    try:
        writer.write(b"late")
    except OSError:
        pass
    else:
        raise AssertionError("a closed writer accepted a message")
    read.close()
    write.close()
