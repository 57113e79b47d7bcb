"""Event-log records and snapshots written by protocol 0.1, read as today's (0.2) shapes.

Protocol 0.1 tagged shards and instances by class: `"kind": "PipelineShardMetadata"` (with
its layer range), `"kind": "TensorShardMetadata"` (no layer range), `"kind":
"PipelineInstance"` and `"kind": "TensorInstance"`. Since 0.2 one `ShardMetadata` and one
`Instance` carry `sharding` ("pipeline" / "tensor"), and a tensor shard names the layers it
holds, every one: `[0, n_layers)`. The conversion loses nothing, so an old node's history is
read (and its files rewritten in the new shape), not refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

_OLD_KINDS: dict[str, str] = {
    "PipelineShardMetadata": "pipeline",
    "TensorShardMetadata": "tensor",
    "PipelineInstance": "pipeline",
    "TensorInstance": "tensor",
}
# An old tag as JSON writes it (inside a string value the quotes would be escaped).
_OLD_TAG = re.compile(rb'"kind"\s*:\s*"(?:Pipeline|Tensor)(?:ShardMetadata|Instance)"')


def needs_upgrade(body: bytes) -> bool:
    """Whether the JSON `body` holds a shard or instance in protocol 0.1's shape."""
    return _OLD_TAG.search(body) is not None


def upgrade_value(value: Any) -> Any:
    """`value` (parsed JSON) with every 0.1 shard and instance in today's shape."""
    if isinstance(value, list):
        return [upgrade_value(item) for item in value]
    if not isinstance(value, dict):
        return value
    upgraded = {key: upgrade_value(item) for key, item in value.items()}
    old_kind = upgraded.get("kind")
    if not isinstance(old_kind, str) or old_kind not in _OLD_KINDS:
        return upgraded
    del upgraded["kind"]
    upgraded["sharding"] = _OLD_KINDS[old_kind]
    if old_kind == "TensorShardMetadata":
        card = upgraded.get("model_card")
        layers = card.get("n_layers") if isinstance(card, dict) else None
        if isinstance(layers, int):
            upgraded["start_layer"], upgraded["end_layer"] = 0, layers
    return upgraded


def upgrade_json(body: bytes) -> bytes:
    """The JSON `body` with every 0.1 shard and instance in today's shape.

    Raises:
        ValueError: `body` is not JSON.
    """
    return json.dumps(upgrade_value(json.loads(body)), separators=(",", ":")).encode()
