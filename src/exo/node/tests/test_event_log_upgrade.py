"""Event logs and snapshots of protocol 0.1 (shards and instances tagged by class) are read
as today's shapes, and their files rewritten in them."""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import pytest

from exo.node.event_log import EventLog
from exo.node.event_log_upgrade import needs_upgrade, upgrade_json
from exo.shared.apply import apply_all
from exo.shared.types.common import NodeId
from exo.shared.types.events import ClusterHistoryStarted, IndexedEvent, InstanceCreated
from exo.shared.types.shards import Sharding
from exo.shared.types.state import State
from exo.testing.builders import indexed, make_instance

NODES = [NodeId("node-a"), NodeId("node-b")]
OLD_INSTANCE = {"pipeline": "PipelineInstance", "tensor": "TensorInstance"}
OLD_SHARD = {"pipeline": "PipelineShardMetadata", "tensor": "TensorShardMetadata"}


def as_protocol_0_1(value: Any) -> Any:
    """`value` (parsed JSON) as protocol 0.1 wrote it: a class tag instead of `sharding`,
    no layer range on a tensor shard."""
    if isinstance(value, list):
        return [as_protocol_0_1(item) for item in value]
    if not isinstance(value, dict):
        return value
    old = {key: as_protocol_0_1(item) for key, item in value.items()}
    if "sharding" in old and "shard_assignments" in old:
        old["kind"] = OLD_INSTANCE[old.pop("sharding")]
    elif "sharding" in old and "device_rank" in old:
        sharding = old.pop("sharding")
        old["kind"] = OLD_SHARD[sharding]
        if sharding == "tensor":
            del old["start_layer"], old["end_layer"]
    return old


def old_record(event: IndexedEvent) -> bytes:
    body = json.dumps(as_protocol_0_1(json.loads(event.model_dump_json()))).encode()
    return f"{zlib.crc32(body):08x} ".encode() + body + b"\n"


def history(sharding: Sharding) -> list[IndexedEvent]:
    instance = make_instance(NODES, sharding=sharding)
    return indexed(
        [
            ClusterHistoryStarted(history_id="history-1", master=NODES[0]),
            InstanceCreated(instance=instance),
        ]
    )


@pytest.mark.parametrize("sharding", ["pipeline", "tensor"])
def test_a_log_line_of_protocol_0_1_is_read_as_today(tmp_path: Path, sharding: Sharding) -> None:
    events = history(sharding)
    old = b"".join(old_record(event) for event in events)
    assert f'"kind": "{OLD_INSTANCE[sharding]}"'.encode() in old
    assert f'"kind": "{OLD_SHARD[sharding]}"'.encode() in old
    path = tmp_path / "event_log.jsonl"
    path.write_bytes(old)

    log = EventLog(path)
    state = log.load()

    assert log.events == events
    assert [instance.sharding for instance in state.instances.values()] == [sharding]
    rewritten = path.read_bytes()
    assert not needs_upgrade(rewritten)
    assert b'"kind":"InstanceCreated"' in rewritten  # other tags stay
    assert EventLog(path).read_all() == events  # the new shape reads back the same


def test_a_tensor_shard_of_protocol_0_1_holds_every_layer() -> None:
    [_, created] = history("tensor")
    old = old_record(created).partition(b" ")[2].strip()
    old_shards = json.loads(old)["event"]["instance"]["shard_assignments"]["runner_to_shard"]
    assert all("start_layer" not in shard for shard in old_shards.values())
    restored = IndexedEvent.model_validate_json(upgrade_json(old))
    assert restored == created
    assert isinstance(restored.event, InstanceCreated)
    for shard in restored.event.instance.shard_assignments.runner_to_shard.values():
        assert (shard.start_layer, shard.end_layer) == (0, shard.model_card.n_layers)


def test_a_snapshot_of_protocol_0_1_is_read_and_rewritten(tmp_path: Path) -> None:
    events = history("tensor")
    state = apply_all(State(), events)
    body = json.dumps(as_protocol_0_1(json.loads(state.model_dump_json()))).encode()
    assert needs_upgrade(body)
    path = tmp_path / "event_log.jsonl"
    header = {
        "format": 1,
        "idx": state.last_event_applied_idx,
        "last_event_digest": None,
        "sha256": hashlib.sha256(body).hexdigest(),
        "bytes": len(body),
    }
    path.with_suffix(".snapshot").write_bytes(json.dumps(header).encode() + b"\n" + body)

    assert EventLog(path).load() == state
    assert not needs_upgrade(path.with_suffix(".snapshot").read_bytes())
    assert EventLog(path).load() == state


def test_a_prompt_quoting_an_old_tag_is_left_alone() -> None:
    text = '{"kind": "TensorInstance"}'
    body = json.dumps({"kind": "TaskCreated", "prompt": text}).encode()
    assert not needs_upgrade(body)
    assert json.loads(upgrade_json(body))["prompt"] == text
