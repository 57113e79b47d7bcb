"""A draft model on a spare node (issue 43: "placed on the same node or on another node of
the cluster"): placement puts it on a node outside the target's group that rank 0 reaches and
that has room, in a draft runner of its own (`InstanceDraft.runner`), counted there; the
worker of that node creates, fetches, loads and warms that runner up apart from the ranks,
which neither wait for it nor break with it; the state records its status without counting
it in the instance's readiness or failures; rank 0 is told where to ask for drafts."""

from __future__ import annotations

import pytest

from exo.master.placement import (
    draft_runner_id_for,
    place_instance,
    placement_previews,
    rendezvous_port,
)
from exo.master.placement_memory import (
    draft_bytes,
    draft_runner_bytes,
    draft_unallocated_bytes,
    placement_room,
    required_memory_bytes,
    runner_bytes,
)
from exo.shared.apply import apply_event
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.kv_cache_memory import DEFAULT_KV_CACHE_TOKENS
from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.events import InstanceDeleted, RunnerStatusUpdated
from exo.shared.types.instances import Instance
from exo.shared.types.nodes import DownloadCompleted, NodeInfo, NodeSpeed, TopologyEdge
from exo.shared.types.runners import (
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerReady,
    RunnerStatus,
)
from exo.shared.types.state import State
from exo.shared.types.tasks import (
    CreateRunner,
    DownloadModel,
    LoadModel,
    Shutdown,
    StartWarmup,
)
from exo.testing.builders import MIB, make_node_info, make_node_speed, make_state
from exo.worker.main import draft_link_options, runner_options_for
from exo.worker.plan import LocalRunner, plan
from exo.worker.runner.draft_serving import remote_draft_of
from exo.worker.runner.options import RunnerOptions

CARDS = load_builtin_cards()
QWEN3_8B = CARDS[ModelId("Qwen/Qwen3-8B")]
QWEN3_0_6B = CARDS[ModelId("Qwen/Qwen3-0.6B")]
NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
NODE_C = NodeId("node-c")
INSTANCE_ID = InstanceId("instance-1")
TOKENS = DEFAULT_KV_CACHE_TOKENS
TARGET_BYTES = required_memory_bytes(QWEN3_8B, kv_cache_tokens=TOKENS)
DRAFT_RUNNER_BYTES = draft_runner_bytes(QWEN3_0_6B, TOKENS)


def node(available_bytes: int) -> NodeInfo:
    return make_node_info(available_bytes // MIB + 1)


def cluster(nodes: dict[NodeId, NodeInfo], links: list[tuple[NodeId, NodeId]]) -> State:
    """`nodes`, each pair in `links` measured both ways (node X reaches node Y at
    10.0.0.<Y's letter>)."""
    edges: dict[NodeId, dict[NodeId, TopologyEdge]] = {}
    for a, b in links:
        for source, sink in ((a, b), (b, a)):
            edges.setdefault(source, {})[sink] = TopologyEdge(
                source=source,
                sink=sink,
                address=address_of(sink),
                latency_ms=0.3,
                bandwidth_mbps=1000,
            )
    return make_state(nodes=nodes).model_copy(update={"topology": edges})


def address_of(node_id: NodeId) -> str:
    return f"10.0.0.{ord(str(node_id)[-1]) - ord('a') + 1}"


def placed_on_a_with_spare_b() -> tuple[State, Instance]:
    """The target fits A alone (B could not hold it), the draft fits B: A runs the
    target, B the draft."""
    state = cluster(
        {NODE_A: node(TARGET_BYTES), NODE_B: node(DRAFT_RUNNER_BYTES)}, [(NODE_A, NODE_B)]
    )
    instance = place_instance(QWEN3_8B, state, INSTANCE_ID, cards=CARDS)
    return state.model_copy(update={"instances": {INSTANCE_ID: instance}}), instance


# --- placement -------------------------------------------------------------------------


def test_the_draft_runs_on_a_spare_node_in_a_runner_of_its_own() -> None:
    _state, instance = placed_on_a_with_spare_b()
    assert instance.shard_assignments.node_to_runner.keys() == {NODE_A}
    draft = instance.draft
    assert draft is not None and draft.model_id == QWEN3_0_6B.model_id
    assert draft.node_id == NODE_B and draft.runner is not None
    assert draft.runner.runner_id == draft_runner_id_for(INSTANCE_ID) == "instance-1-draft"
    assert draft.runner.address == address_of(NODE_B)  # as A reaches B
    assert draft.runner.port == rendezvous_port(INSTANCE_ID, "-draft")
    assert instance.draft_left_out is None


def test_the_spare_nodes_memory_counts_the_draft_runner_until_ready_then_its_kv() -> None:
    state, instance = placed_on_a_with_spare_b()
    (shard,) = instance.shard_assignments.runner_to_shard.values()
    room = placement_room(state)
    # A promises only the target's runner; B the draft runner, process included.
    assert room[NODE_A].promised_bytes == runner_bytes(shard, TOKENS)
    assert room[NODE_B].promised_bytes == DRAFT_RUNNER_BYTES
    assert room[NODE_B].promised_runners == 1
    assert draft_runner_bytes(QWEN3_0_6B, TOKENS) > draft_bytes(QWEN3_0_6B, TOKENS)
    assert instance.draft is not None and instance.draft.runner is not None
    ready = state.model_copy(update={"runners": {instance.draft.runner.runner_id: RunnerReady()}})
    assert placement_room(ready)[NODE_B].promised_bytes == draft_unallocated_bytes(
        QWEN3_0_6B, TOKENS
    )


def test_without_a_spare_with_room_or_a_link_the_draft_stays_in_rank_zero() -> None:
    both = TARGET_BYTES + draft_bytes(QWEN3_0_6B, TOKENS)
    # B is too small for the draft runner: the draft goes to rank 0's node as before.
    small = cluster({NODE_A: node(both), NODE_B: node(DRAFT_RUNNER_BYTES // 2)}, [(NODE_A, NODE_B)])
    instance = place_instance(QWEN3_8B, small, INSTANCE_ID, cards=CARDS)
    assert instance.draft is not None
    assert (instance.draft.node_id, instance.draft.runner) == (NODE_A, None)
    # B has room but no measured link from A: rank 0 could not reach it.
    unlinked = cluster({NODE_A: node(both), NODE_B: node(DRAFT_RUNNER_BYTES)}, [])
    instance = place_instance(QWEN3_8B, unlinked, INSTANCE_ID, cards=CARDS)
    assert instance.draft is not None
    assert (instance.draft.node_id, instance.draft.runner) == (NODE_A, None)
    # A placement restricted to A does not put the draft on B.
    linked = cluster({NODE_A: node(both), NODE_B: node(DRAFT_RUNNER_BYTES)}, [(NODE_A, NODE_B)])
    instance = place_instance(QWEN3_8B, linked, INSTANCE_ID, node_ids=[NODE_A], cards=CARDS)
    assert instance.draft is not None
    assert (instance.draft.node_id, instance.draft.runner) == (NODE_A, None)


def test_rank_zeros_node_can_keep_the_draft_in_its_runner() -> None:
    # --no-draft-on-spare on rank 0's node: a spare with room is not used (measured on one
    # machine the draft in rank 0's process was faster; an operator may see the same).
    both = TARGET_BYTES + draft_bytes(QWEN3_0_6B, TOKENS)
    keeping = node(both).model_copy(update={"draft_on_spare": False})
    state = cluster({NODE_A: keeping, NODE_B: node(DRAFT_RUNNER_BYTES)}, [(NODE_A, NODE_B)])
    instance = place_instance(QWEN3_8B, state, INSTANCE_ID, cards=CARDS)
    assert instance.draft is not None
    assert (instance.draft.node_id, instance.draft.runner) == (NODE_A, None)
    # The spare's own option does not matter: rank 0's node decides.
    spare_says_no = node(DRAFT_RUNNER_BYTES).model_copy(update={"draft_on_spare": False})
    state = cluster({NODE_A: node(both), NODE_B: spare_says_no}, [(NODE_A, NODE_B)])
    instance = place_instance(QWEN3_8B, state, INSTANCE_ID, cards=CARDS)
    assert instance.draft is not None and instance.draft.node_id == NODE_B


def test_a_split_puts_its_draft_on_the_third_node_and_previews_say_where() -> None:
    per_rank = TARGET_BYTES * 3 // 4
    state = cluster(
        {NODE_A: node(per_rank), NODE_B: node(per_rank), NODE_C: node(DRAFT_RUNNER_BYTES)},
        [(NODE_A, NODE_B), (NODE_A, NODE_C), (NODE_B, NODE_C)],
    )
    split = place_instance(QWEN3_8B, state, INSTANCE_ID, min_nodes=2, cards=CARDS)
    assert split.shard_assignments.node_to_runner.keys() == {NODE_A, NODE_B}
    assert split.draft is not None and split.draft.node_id == NODE_C
    assert split.draft.runner is not None
    previews = {
        (p.sharding, p.node_count): p for p in placement_previews(QWEN3_8B, state, cards=CARDS)
    }
    two = previews[("pipeline", 2)]
    assert two.error is None and two.draft is not None and two.draft.node_id == NODE_C


def test_a_draft_runner_on_a_node_of_the_group_is_refused() -> None:
    _state, instance = placed_on_a_with_spare_b()
    assert instance.draft is not None
    with pytest.raises(ValueError, match="holds no rank"):
        Instance.model_validate(
            {
                **instance.model_dump(),
                "draft": instance.draft.model_copy(update={"node_id": NODE_A}).model_dump(),
            }
        )


# --- the worker --------------------------------------------------------------------------


def local(status: RunnerStatus) -> LocalRunner:
    return LocalRunner(INSTANCE_ID, status, frozenset())


def test_the_spare_nodes_worker_creates_fetches_loads_and_warms_up_the_draft_runner() -> None:
    state, instance = placed_on_a_with_spare_b()
    assert instance.draft is not None and instance.draft.runner is not None
    draft_runner = instance.draft.runner.runner_id
    assert plan(NODE_B, state, {}, {}, {}, 0.0) == CreateRunner(
        instance_id=INSTANCE_ID, runner_id=draft_runner
    )
    idle = {draft_runner: local(RunnerIdle())}
    fetch = plan(NODE_B, state, idle, {}, {}, 0.0)
    assert isinstance(fetch, DownloadModel)
    assert fetch.shard.model_card == QWEN3_0_6B
    assert (fetch.shard.start_layer, fetch.shard.end_layer) == (0, QWEN3_0_6B.n_layers)
    done = {QWEN3_0_6B.model_id: DownloadCompleted(path="/models/qwen3-0.6b")}
    # Loads at once: the target's ranks are not even created (nothing waits on them).
    assert plan(NODE_B, state, idle, done, {}, 0.0) == LoadModel(
        instance_id=INSTANCE_ID, runner_id=draft_runner, model_dir="/models/qwen3-0.6b"
    )
    loaded = {draft_runner: local(RunnerLoaded())}
    assert plan(NODE_B, state, loaded, done, {}, 0.0) == StartWarmup(
        instance_id=INSTANCE_ID, runner_id=draft_runner
    )
    # Ready: nothing more (no generation is forwarded to it, nor a group joined).
    assert plan(NODE_B, state, {draft_runner: local(RunnerReady())}, done, {}, 0.0) is None
    # Failed: shut down (and retried after a back-off by the worker); instance deleted: too.
    failed = {draft_runner: local(RunnerFailed(error_message="port taken"))}
    assert plan(NODE_B, state, failed, done, {}, 0.0) == Shutdown(runner_id=draft_runner)
    gone = state.model_copy(update={"instances": {}})
    ready = {draft_runner: local(RunnerReady())}
    assert plan(NODE_B, gone, ready, done, {}, 0.0) == Shutdown(runner_id=draft_runner)
    # Backing off after a failure: not created again until due.
    assert plan(NODE_B, state, {}, done, {draft_runner: 30.0}, 0.0) is None


def test_rank_zero_neither_fetches_nor_waits_for_a_draft_on_a_spare_node() -> None:
    state, instance = placed_on_a_with_spare_b()
    rank_zero = instance.shard_assignments.rank_zero_runner()
    idle = {rank_zero: local(RunnerIdle())}
    fetch = plan(NODE_A, state, idle, {}, {}, 0.0)
    assert isinstance(fetch, DownloadModel) and fetch.shard.model_card == QWEN3_8B
    target_only = {QWEN3_8B.model_id: DownloadCompleted(path="/models/qwen3-8b")}
    assert plan(NODE_A, state, idle, target_only, {}, 0.0) == LoadModel(
        instance_id=INSTANCE_ID, runner_id=rank_zero, model_dir="/models/qwen3-8b"
    )
    # A failed draft runner breaks nothing of the target's.
    assert instance.draft is not None and instance.draft.runner is not None
    failed_draft = state.model_copy(
        update={"runners": {instance.draft.runner.runner_id: RunnerFailed(error_message="x")}}
    )
    ready = {rank_zero: local(RunnerReady())}
    assert plan(NODE_A, failed_draft, ready, target_only, {}, 0.0) is None


def test_rank_zero_is_told_where_to_ask_and_the_draft_runner_where_to_listen() -> None:
    _state, instance = placed_on_a_with_spare_b()
    assert instance.draft is not None and instance.draft.runner is not None
    link = instance.draft.runner
    base = runner_options_for(RunnerOptions(), instance.kv_cache_tokens, instance.draft)
    rank_zero = draft_link_options(base, instance, instance.shard_assignments.rank_zero_runner())
    assert (rank_zero.remote_draft_host, rank_zero.remote_draft_port) == (
        address_of(NODE_B),
        link.port,
    )
    assert rank_zero.draft_server_port is None
    remote = remote_draft_of(rank_zero, INSTANCE_ID)
    assert remote is not None
    assert (remote.host, remote.port, remote.model_id) == (
        address_of(NODE_B),
        link.port,
        QWEN3_0_6B.model_id,
    )
    assert remote.credentials is None and remote.instance_id == INSTANCE_ID  # no secret
    keyed = rank_zero.model_copy(update={"rank_group_key": "ab" * 32})
    secret = remote_draft_of(keyed, INSTANCE_ID)
    assert secret is not None and secret.credentials is not None
    assert (secret.credentials.key, secret.credentials.instance_id) == (b"\xab" * 32, INSTANCE_ID)
    server = draft_link_options(base, instance, link.runner_id)
    assert server.draft_server_port == link.port
    assert (server.remote_draft_host, server.remote_draft_port) == (None, None)
    # An instance drafting in rank 0: neither.
    plain = draft_link_options(
        base,
        instance.model_copy(
            update={"draft": instance.draft.model_copy(update={"runner": None, "node_id": NODE_A})}
        ),
        instance.shard_assignments.rank_zero_runner(),
    )
    assert (plain.draft_server_port, plain.remote_draft_host) == (None, None)
    assert remote_draft_of(plain, INSTANCE_ID) is None


# --- the state ---------------------------------------------------------------------------


def test_the_state_keeps_the_draft_runners_status_apart_from_the_instances() -> None:
    state, instance = placed_on_a_with_spare_b()
    assert instance.draft is not None and instance.draft.runner is not None
    draft_runner = instance.draft.runner.runner_id
    rank_zero = instance.shard_assignments.rank_zero_runner()
    failed = apply_event(
        state,
        RunnerStatusUpdated(
            runner_id=draft_runner, node_id=NODE_B, status=RunnerFailed(error_message="x")
        ),
    )
    assert isinstance(failed.runners[draft_runner], RunnerFailed)
    assert failed.runner_nodes[draft_runner] == NODE_B
    assert failed.instance_failures == {}  # the target is not failing
    ready = apply_event(
        failed, RunnerStatusUpdated(runner_id=rank_zero, node_id=NODE_A, status=RunnerReady())
    )
    assert isinstance(ready.runners[rank_zero], RunnerReady)
    deleted = apply_event(ready, InstanceDeleted(instance_id=INSTANCE_ID))
    assert draft_runner not in deleted.runners and draft_runner not in deleted.runner_nodes
    # A status from a runner no instance has is still dropped.
    stray = apply_event(
        deleted,
        RunnerStatusUpdated(
            runner_id=RunnerId("nobody-draft"), node_id=NODE_B, status=RunnerIdle()
        ),
    )
    assert stray.runners == {}


def test_a_spare_measured_slower_than_rank_zeros_node_is_passed_over() -> None:
    both = TARGET_BYTES + draft_bytes(QWEN3_0_6B, TOKENS)
    fast = make_node_speed()
    slow = fast.model_copy(
        update={"int4_decode_bytes_per_second": fast.int4_decode_bytes_per_second / 2}
    )

    def placed(spare_speed: NodeSpeed | None) -> Instance:
        nodes = {
            NODE_A: node(both).model_copy(update={"speed": fast}),
            NODE_B: node(DRAFT_RUNNER_BYTES).model_copy(update={"speed": spare_speed}),
        }
        state = cluster(nodes, [(NODE_A, NODE_B)])
        return place_instance(QWEN3_8B, state, INSTANCE_ID, cards=CARDS)

    # Rank 0 waits for its drafts: a slower spare would slow every step; rank 0 drafts.
    behind = placed(slow).draft
    assert behind is not None and (behind.node_id, behind.runner) == (NODE_A, None)
    # As fast (or not measured): the spare.
    for speed in (fast, None):
        spared = placed(speed).draft
        assert spared is not None and spared.node_id == NODE_B and spared.runner is not None
