"""The master's answer to `ControlDownload`: the node is asked, unless it is unknown (404),
or, for a delete, a placed instance has a shard there (409), or, for a start, the model
needs more memory than the cluster's nodes have together (409)."""

from __future__ import annotations

from exo.master.decisions import events_for_command
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.commands import ControlDownload
from exo.shared.types.common import CommandId, ModelId, NodeId
from exo.shared.types.downloads import DownloadAction
from exo.shared.types.events import CommandRejected, DownloadControlled, Event
from exo.shared.types.models import ModelCard
from exo.shared.types.state import State
from exo.testing.builders import make_instance, make_node_info, make_state, smollm2_card

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
CARD = smollm2_card()


GIB_IN_MIB = 1024


def decide(
    state: State, node_id: NodeId, action: DownloadAction, card: ModelCard = CARD
) -> list[Event]:
    command = ControlDownload(
        command_id=CommandId("c-1"), node_id=node_id, card=card, action=action
    )
    return events_for_command(state, NODE_A, command, {card.model_id: card})


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


def test_a_model_larger_than_the_clusters_memory_is_not_downloaded() -> None:
    """GLM-4.5-Air (218 GB of files, ~74 GiB to run in the engine's int4) on a 24 GiB node
    and a 16 GiB one: no placement could ever run it, so its download is refused with the
    sizes; with 2 x 48 GiB (a split's room) it is downloaded."""
    glm = load_builtin_cards()[ModelId("zai-org/GLM-4.5-Air")]
    small = {
        NODE_A: make_node_info(2 * GIB_IN_MIB, total_mb=24 * GIB_IN_MIB),
        NODE_B: make_node_info(16 * GIB_IN_MIB),
    }
    [rejected] = decide(make_state(nodes=small), NODE_A, "start", glm)
    assert isinstance(rejected, CommandRejected) and rejected.status_code == 409
    assert rejected.reason == (
        "zai-org/GLM-4.5-Air does not fit this cluster: it needs 73.7 GiB of memory to run "
        "(218 GB of files), and the cluster's 2 node(s) have 40.0 GiB in all (the largest "
        "24.0 GiB); add nodes before downloading it"
    )
    for action in ("cancel", "delete"):  # what is already there can still be dealt with
        assert isinstance(
            decide(make_state(nodes=small), NODE_A, action, glm)[0], DownloadControlled
        )
    # Judged by total memory, not what is free now: other models may be unloaded first.
    large = {node: make_node_info(1, total_mb=48 * GIB_IN_MIB) for node in (NODE_A, NODE_B)}
    assert isinstance(decide(make_state(nodes=large), NODE_A, "start", glm)[0], DownloadControlled)
