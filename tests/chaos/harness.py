"""What every chaos scenario shares: a load of streaming chats that classifies how each one
ended, the time until the cluster serves again after a fault, and the row a scenario reports.

A request ends one of three ways:
- "ok": its stream ended with `data: [DONE]`;
- "failed": it failed cleanly, in the Chat Completions dialect's shape (an HTTP error with
  a JSON `error` body, or an SSE event carrying `error`);
- "unclean": anything else (no answer within the client's timeout, a transport error, a
  stream that stops without its end) — a chaos scenario fails on any of these.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode

QUESTION = "What is the capital of France? Answer in one sentence."
# Generous: a machine loaded by other work has taken over a minute to prefill under load.
CLIENT_TIMEOUT_SECONDS = 120.0
LOAD_MAX_TOKENS = 24


CLONE_NEWNET = 0x40000000
_thread_netns = threading.local()


def current_netns() -> str | None:
    """The network namespace the calling thread entered with `enter_netns`, or None."""
    name: str | None = getattr(_thread_netns, "name", None)
    return name


def enter_netns(name: str) -> None:
    """Move the calling thread (only it: a network namespace is per thread) into the network
    namespace `name` (created by `ip netns add`); sockets it opens afterwards live there."""
    descriptor = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(descriptor, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(descriptor)
    _thread_netns.name = name


@dataclass(frozen=True)
class Ended:
    sent: float
    seconds: float
    kind: str  # "ok" | "failed" | "unclean"
    detail: str


def stream_chat(
    node: ExoNode, max_tokens: int = LOAD_MAX_TOKENS, on_chunk: Any = None
) -> tuple[str, str]:  # fmt: skip
    """One greedy streaming chat through `node`: ("ok" | "failed" | "unclean", detail)."""
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
    }
    try:
        with httpx.stream(
            "POST", f"{node.url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_SECONDS
        ) as response:
            if response.status_code != 200:
                text = response.read().decode(errors="replace")
                try:
                    shaped = "message" in json.loads(text)["error"]
                except (ValueError, KeyError, TypeError):
                    shaped = False
                return ("failed" if shaped else "unclean"), f"{response.status_code} {text[:300]}"
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    return "ok", ""
                if not line.startswith("data: "):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    return "failed", f"error event: {json.dumps(event)[:300]}"
                if on_chunk is not None:
                    on_chunk()
            return "unclean", "the stream stopped without [DONE] or an error event"
    except (httpx.HTTPError, ValueError) as error:
        return "unclean", repr(error)


@dataclass
class Load:
    """`streams` client threads sending streaming chats through `via`, back to back, until
    stopped; every request's end is recorded."""

    via: ExoNode
    streams: int = 2
    netns: str | None = None  # the clients' network namespace (None: this process's)
    ended: list[Ended] = field(default_factory=list)
    mid_stream: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for _ in range(self.streams):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=CLIENT_TIMEOUT_SECONDS + 30)
        hung = sum(thread.is_alive() for thread in self._threads)
        if hung:
            self.ended.append(Ended(time.monotonic(), 0.0, "unclean", f"{hung} clients hung"))

    def wait_mid_stream(self, timeout: float = 300.0) -> None:
        """Until some request has streamed a chunk and not ended yet."""
        deadline = time.monotonic() + timeout
        while self.mid_stream == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request was mid-stream within {timeout:.0f} s")
            time.sleep(0.05)

    def since(self, moment: float) -> list[Ended]:
        """The requests still open or sent at `moment` or later (affected by a fault then)."""
        return [e for e in self.ended if e.sent + e.seconds >= moment]

    def count(self, kind: str, since: float = 0.0) -> int:
        return sum(e.kind == kind for e in self.since(since))

    def unclean(self) -> list[Ended]:
        return [e for e in self.ended if e.kind == "unclean"]

    def _run(self) -> None:
        if self.netns is not None:
            enter_netns(self.netns)
        while not self._stop.is_set():
            sent = time.monotonic()
            streamed = False

            def chunk() -> None:
                nonlocal streamed
                if not streamed:
                    streamed = True
                    with self._lock:
                        self.mid_stream += 1

            kind, detail = stream_chat(self.via, on_chunk=chunk)
            if streamed:
                with self._lock:
                    self.mid_stream -= 1
            with self._lock:
                self.ended.append(Ended(sent, time.monotonic() - sent, kind, detail))
            if kind != "ok":
                self._stop.wait(0.5)  # a failing cluster is not hammered


def short_chat(node: ExoNode) -> httpx.Response:
    """A short greedy (non-streamed) chat through `node`."""
    return httpx.post(
        f"{node.url}/v1/chat/completions",
        json={
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": 4,
        },
        timeout=CLIENT_TIMEOUT_SECONDS,
    )


def serves(node: ExoNode) -> bool:
    """A short greedy chat through `node` answers 200 with content."""
    response = short_chat(node)
    return response.status_code == 200 and bool(response.json()["choices"][0]["message"])


@dataclass
class Row:
    """One line of the chaos table."""

    fault: str
    recovery_s: float | None = None
    requests: int = 0
    failed: int = 0
    unclean: int = 0
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"[{self.fault}] {text}", flush=True)

    def from_load(self, load: Load, fault_at: float) -> None:
        affected = load.since(fault_at)
        self.requests = len(affected)
        self.failed = sum(e.kind == "failed" for e in affected)
        self.unclean = len(load.unclean())
        for ended in load.unclean()[:5]:
            self.note(f"unclean after {ended.seconds:.1f} s: {ended.detail}")
        for ended in [e for e in affected if e.kind == "failed"][:3]:
            self.note(f"failed cleanly after {ended.seconds:.1f} s: {ended.detail[:200]}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "recovery_s": self.recovery_s,
            "requests": self.requests,
            "failed_cleanly": self.failed,
            "unclean": self.unclean,
            "notes": self.notes,
            "error": self.error,
        }


def format_table(rows: list[Row]) -> str:
    lines = [
        f"{'fault':<44} {'recovery':>9} {'requests':>8} {'failed':>6} {'unclean':>7}  result",
    ]
    for row in rows:
        recovery = f"{row.recovery_s:.1f} s" if row.recovery_s is not None else "-"
        result = "ok" if row.error is None else f"FAIL: {row.error[:120]}"
        lines.append(
            f"{row.fault:<44} {recovery:>9} {row.requests:>8} {row.failed:>6} "
            f"{row.unclean:>7}  {result}"
        )
    return "\n".join(lines)
