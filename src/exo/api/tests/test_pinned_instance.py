"""The `X-Exo-Instance` header pins a generation to one instance of its model, in every
dialect: the master runs it there or refuses it, and the API never sends it elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.api.tests.test_instance_loss_retry import LOST, LosingCluster
from exo.master.decisions import events_for_command
from exo.shared.constants import INSTANCE_HEADER
from exo.shared.types.commands import ComputeEmbeddings, GenerateText
from exo.shared.types.common import InstanceId
from exo.shared.types.events import CommandRejected
from exo.shared.types.runners import RunnerLoading, RunnerReady
from exo.testing.builders import SMOLLM2, make_card, make_instance, make_state
from exo.testing.scripted_cluster import SCRIPTED_ANSWER, ScriptedCluster

OTHER_MODEL = "other/model"


class DecidingCluster(ScriptedCluster):
    """Two instances of SmolLM2 and one of another model; every command goes through the
    master's own decision, and a rejection comes back as the real client raises it."""

    def __init__(self) -> None:
        super().__init__()
        other = make_card(model_id=OTHER_MODEL)
        self.cards[OTHER_MODEL] = other
        instances = [
            make_instance(self.node_id, instance_id="instance-1"),
            make_instance(self.node_id, instance_id="instance-2"),
            make_instance(self.node_id, other, instance_id="instance-3"),
        ]
        self.state = make_state(
            instances=instances,
            runners={
                instance.shard_assignments.rank_zero_runner(): (self.node_id, RunnerReady())
                for instance in instances
            },
        )

    def start_loading(self, instance_id: str) -> None:
        """Make `instance_id`'s runner a loading one (as after a fresh placement)."""
        runner_id = self.state.instances[
            InstanceId(instance_id)
        ].shard_assignments.rank_zero_runner()
        loading = RunnerLoading(layers_loaded=3, total_layers=30)
        self.state = self.state.model_copy(
            update={"runners": {**self.state.runners, runner_id: loading}}
        )

    async def submit(self, command: GenerateText | ComputeEmbeddings, timeout: float = 0.0) -> None:
        events = events_for_command(self.state, self.node_id, command, cast(Any, self.cards))
        if isinstance(events[0], CommandRejected):
            raise CommandRejectedError(events[0].reason, events[0].status_code)
        await super().submit(command)


def client_for(cluster: ScriptedCluster) -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as test_client:
        yield test_client


REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}),
    ("/v1/responses", {"input": "Hi"}),
    ("/ollama/api/chat", {"messages": [{"role": "user", "content": "Hi"}], "stream": False}),
]


@pytest.mark.parametrize(("path", "body"), REQUESTS)
def test_the_header_pins_the_generation_in_every_dialect(path: str, body: dict[str, Any]) -> None:
    cluster = DecidingCluster()
    for http in client_for(cluster):
        for instance in ("instance-2", "instance-1", "instance-2"):
            response = http.post(
                path, json={"model": SMOLLM2, **body}, headers={INSTANCE_HEADER: instance}
            )
            assert response.status_code == 200, response.text
            assert SCRIPTED_ANSWER in response.text
        unpinned = http.post(path, json={"model": SMOLLM2, **body})
        assert unpinned.status_code == 200, unpinned.text
    assert [command.instance_id for command in cluster.submitted] == [
        InstanceId("instance-2"),
        InstanceId("instance-1"),
        InstanceId("instance-2"),
        None,
    ]


@pytest.mark.parametrize(
    ("instance", "model", "status", "message"),
    [
        ("instance-9", SMOLLM2, 404, "no instance 'instance-9'"),
        ("instance-3", SMOLLM2, 400, f"instance 'instance-3' serves {OTHER_MODEL}, not {SMOLLM2}"),
        ("instance-1", OTHER_MODEL, 400, f"serves {SMOLLM2}, not {OTHER_MODEL}"),
    ],
)
def test_a_header_naming_an_instance_that_cannot_run_it_is_refused_in_the_dialects_shape(
    instance: str, model: str, status: int, message: str
) -> None:
    cluster = DecidingCluster()
    for http in client_for(cluster):
        chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
        response = http.post("/v1/chat/completions", json=chat, headers={INSTANCE_HEADER: instance})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert message in error["message"]
        assert error["param"] == INSTANCE_HEADER
        claude = http.post(
            "/v1/messages",
            json={**chat, "max_tokens": 8},
            headers={INSTANCE_HEADER: instance},
        )
        assert claude.status_code == status, claude.text
        assert claude.json()["type"] == "error"
        assert message in claude.json()["error"]["message"]
    assert cluster.submitted == []


@pytest.mark.parametrize("value", ["", "   ", "instance-\u00e9"])
def test_a_header_that_is_no_instance_id_is_a_400(value: str) -> None:
    cluster = DecidingCluster()
    for http in client_for(cluster):
        chat = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}]}
        response = http.post(
            "/v1/chat/completions",
            json=chat,
            headers=[(INSTANCE_HEADER.encode(), value.encode("latin-1"))],
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == INSTANCE_HEADER
        assert "must be an instance id" in error["message"]
    assert cluster.submitted == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_pinned_generation_that_lost_its_instance_is_not_sent_elsewhere(stream: bool) -> None:
    cluster = LosingCluster(losses=1)  # unpinned, the second try would be answered
    for http in client_for(cluster):
        chat = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}]}
        response = http.post(
            "/v1/chat/completions",
            json={**chat, "stream": stream},
            headers={INSTANCE_HEADER: "instance-1"},
        )
        if stream:  # the stream had started: the error is its event
            assert response.status_code == 200
            assert f'"message": "{LOST}", "type": "service_unavailable_error"' in response.text
            assert SCRIPTED_ANSWER not in response.text
        else:
            assert response.status_code == 503, response.text
            assert response.json()["error"]["message"] == LOST
    assert len(cluster.submitted) == 1


@pytest.mark.parametrize(("path", "body"), REQUESTS)
def test_a_header_naming_a_loading_instance_is_refused_at_once_in_every_dialect(
    path: str, body: dict[str, Any]
) -> None:
    cluster = DecidingCluster()
    cluster.start_loading("instance-2")
    for http in client_for(cluster):
        response = http.post(
            path, json={"model": SMOLLM2, **body}, headers={INSTANCE_HEADER: "instance-2"}
        )
        assert response.status_code == 503, response.text
        assert f"instance instance-2 of {SMOLLM2} is not ready (loading)" in response.text
        # Unpinned, the same request goes to the ready instance.
        unpinned = http.post(path, json={"model": SMOLLM2, **body})
        assert unpinned.status_code == 200, unpinned.text
    assert [command.instance_id for command in cluster.submitted] == [None]
