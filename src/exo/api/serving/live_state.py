"""The cluster state as a live stream for the dashboard: a snapshot, then JSON Patches.

`GET /events` (Server-Sent Events) sends `event: snapshot` with the whole state (the body
of `GET /state`), then `event: patch` with the RFC 6902 operations that turn the state the
client holds into the current one. Changes are pulled, not queued: when the client is ready
for more, it gets one patch from what it last received to the state now, so a burst of
events costs one message and a slow client costs no memory beyond the copy it last got
(and the socket's own buffer, which uvicorn's flow control bounds). When that patch would
be larger than the state itself, the client gets a fresh snapshot instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import anyio

from exo.shared.types.state import State

PATCH_INTERVAL_SECONDS = 0.2
"""At most one patch per client this often: bursts of events are coalesced."""
KEEPALIVE_SECONDS = 15.0
"""A comment line this often keeps proxies and the browser from closing an idle stream."""
RECONNECT_MILLISECONDS = 2000
"""The `retry:` the browser waits before reconnecting (it then gets a fresh snapshot)."""

JsonValue = Any
PatchOperation = dict[str, Any]


def _escape_pointer_token(key: str) -> str:
    # RFC 6901 section 3: "~" is written "~0" and "/" is written "~1" (model ids hold "/").
    return key.replace("~", "~0").replace("/", "~1")


def json_patch(old: JsonValue, new: JsonValue) -> list[PatchOperation]:
    """The RFC 6902 operations that turn `old` into `new` (JSON values: dicts, lists,
    strings, numbers, booleans, None).

    Only `add`, `remove` and `replace` are used, so a client needs no more than those three.
    Objects are compared key by key; a list that changed length keeps its common prefix
    and adds or removes at its end; a value of another type is replaced whole.

    Returns:
        The operations in the order they must be applied; empty when `old == new`.
    """
    operations: list[PatchOperation] = []
    _diff(old, new, "", operations)
    return operations


def _diff(old: JsonValue, new: JsonValue, path: str, operations: list[PatchOperation]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in old:
            if key not in new:
                operations.append({"op": "remove", "path": f"{path}/{_escape_pointer_token(key)}"})
        for key, value in new.items():
            child = f"{path}/{_escape_pointer_token(key)}"
            if key in old:
                _diff(old[key], value, child, operations)
            else:
                operations.append({"op": "add", "path": child, "value": value})
        return
    if isinstance(old, list) and isinstance(new, list):
        common = min(len(old), len(new))
        for index in range(common):
            _diff(old[index], new[index], f"{path}/{index}", operations)
        # Remove from the end first so each index is still valid when its op is applied.
        for index in range(len(old) - 1, common - 1, -1):
            operations.append({"op": "remove", "path": f"{path}/{index}"})
        for value in new[common:]:
            operations.append({"op": "add", "path": f"{path}/-", "value": value})
        return
    # `1 == 1.0 == True` in Python, not in JSON: an equal value of another type is replaced.
    if type(old) is not type(new) or old != new:
        operations.append({"op": "replace", "path": path, "value": new})


def server_sent_event(event: str, data: JsonValue) -> str:
    """One SSE message: `event: <event>` and its JSON on a single `data:` line (JSON has no
    raw newlines, so one line always suffices)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class StateChanges:
    """Where the stream learns of changes: the state now, and an awaitable that returns
    once it may have changed (`ClusterClient.state` and `ClusterClient.state_changed`).

    Args:
        current_state: the node's state now.
        wait_for_change: returns after the next applied event (may return early).
    """

    def __init__(
        self,
        current_state: Callable[[], State],
        wait_for_change: Callable[[], Awaitable[object]],
    ) -> None:
        self.current_state = current_state
        self.wait_for_change = wait_for_change


async def state_stream(
    changes: StateChanges,
    patch_interval_seconds: float = PATCH_INTERVAL_SECONDS,
    keepalive_seconds: float = KEEPALIVE_SECONDS,
) -> AsyncGenerator[str, None]:
    """The text of the `/events` stream, message by message; it never ends on its own.

    Each message is produced only when the consumer asks for the next one, from the state
    at that moment, so nothing queues up behind a slow consumer.
    """
    yield f"retry: {RECONNECT_MILLISECONDS}\n\n"
    state = changes.current_state()
    sent = state.model_dump(mode="json")
    yield server_sent_event("snapshot", {"index": state.last_event_applied_idx, "state": sent})
    last_patch_at = -math.inf
    while True:
        waited = anyio.current_time()
        if changes.current_state() is state:
            with anyio.move_on_after(keepalive_seconds):
                await changes.wait_for_change()
            if changes.current_state() is state:
                if anyio.current_time() - waited >= keepalive_seconds:
                    yield ": keepalive\n\n"
                continue
        # Coalesce: whatever else arrives before the interval is up goes into this patch.
        await anyio.sleep(max(0.0, last_patch_at + patch_interval_seconds - anyio.current_time()))
        state = changes.current_state()
        current = state.model_dump(mode="json")
        patch = json_patch(sent, current)
        last_patch_at = anyio.current_time()
        if not patch:
            continue
        patch_message = server_sent_event(
            "patch", {"index": state.last_event_applied_idx, "patch": patch}
        )
        snapshot_message = server_sent_event(
            "snapshot", {"index": state.last_event_applied_idx, "state": current}
        )
        yield patch_message if len(patch_message) <= len(snapshot_message) else snapshot_message
        sent = current
