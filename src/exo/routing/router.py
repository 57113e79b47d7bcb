"""The node's router: the named topics every component talks through.

This is the single-process router: all topics are in-memory. Payload types are the
pydantic wire types, so a networked router only has to serialise them (their JSON
round-trips are tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exo.shared.types.chunks import Chunk
from exo.shared.types.commands import ForwarderCommand
from exo.shared.types.events import ForwarderEvent, IndexedEvent
from exo.utils.channels import Topic


@dataclass
class Router:
    commands: Topic[ForwarderCommand] = field(default_factory=lambda: Topic("commands"))
    local_events: Topic[ForwarderEvent] = field(default_factory=lambda: Topic("local_events"))
    global_events: Topic[IndexedEvent] = field(default_factory=lambda: Topic("global_events"))
    chunks: Topic[Chunk] = field(default_factory=lambda: Topic("chunks"))
