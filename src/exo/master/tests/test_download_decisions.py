"""The master's answer to `ControlDownload`: the node is asked, unless it is unknown (404)
or, for a delete, a placed instance has a shard there (409)."""

from __future__ import annotations

from exo.master.decisions import events_for_command
from exo.shared.types.commands import ControlDownload
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.downloads import DownloadAction
from exo.shared.types.events import CommandRejected, DownloadControlled, Event
from exo.shared.types.state import State
from exo.testing.builders import make_instance, make_node_info, make_state, smollm2_card

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
CARD = smollm2_card()


def decide(state: State, node_id: NodeId, action: DownloadAction) -> list[Event]:
    command = ControlDownload(
        command_id=CommandId("c-1"), node_id=node_id, card=CARD, action=action
    )
    return events_for_command(state, NODE_A, command, {CARD.model_id: CARD})


def test_a_known_node_is_asked() -> None:
    state = make_state(nodes={NODE_A: make_node_info(1000)})
    for action in ("start", "cancel", "delete"):
        assert decide(state, NODE_A, action) == [
            DownloadControlled(
                node_id=NODE_A, card=CARD, action=action, command_id=CommandId("c-1")
            )
        ]


def test_an_unknown_node_is_404() -> None:
    [rejected] = decide(make_state(nodes={NODE_A: make_node_info(1000)}), NODE_B, "start")
    assert isinstance(rejected, CommandRejected) and rejected.status_code == 404
    assert "node-b" in rejected.reason


def test_delete_is_409_while_an_instance_has_a_shard_on_the_node() -> None:
    nodes = {NODE_A: make_node_info(1000), NODE_B: make_node_info(1000)}
    state = make_state(nodes=nodes, instances=[make_instance(NODE_A, CARD)])
    [rejected] = decide(state, NODE_A, "delete")
    assert isinstance(rejected, CommandRejected) and rejected.status_code == 409
    assert isinstance(decide(state, NODE_A, "cancel")[0], DownloadControlled)
    assert isinstance(decide(state, NODE_B, "delete")[0], DownloadControlled)
