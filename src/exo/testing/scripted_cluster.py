"""A stand-in for `ClusterClient` behind the real FastAPI app: one placed SmolLM2 instance
whose every generation answers with the same short text, and a record of the
`TextGenerationTaskParams` each dialect produced (and of each embeddings / rerank command,
answered with made-up vectors and scores).

For in-process tests of the routes, adapters and error handlers (`create_app(cluster)` with
starlette's `TestClient`), where a real node would cost a model load.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import anyio

from exo.api.serving.cluster_client import LoadOnRequest
from exo.api.serving.load_wait import ReadyTimes
from exo.api.serving.node_stop import NodeStop
from exo.api.wire.images import ImagePolicy
from exo.shared.types.chunks import Chunk, EmbeddingChunk, TokenChunk, Usage
from exo.shared.types.commands import Command, ComputeEmbeddings, GenerateText
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import DownloadStatus
from exo.shared.types.runners import KVCacheUse
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.testing.builders import SMOLLM2, make_instance, make_state, smollm2_card

SCRIPTED_ANSWER = "Hi there."


class ScriptedCluster:
    """What the routes read from `ClusterClient` (`cards`, `state`, `node_id`, `submit`,
    `chunk_stream`, `send_and_forget`), with SmolLM2 placed on one node.

    Every generation streams `answer` as one token chunk and finishes with "stop" and a
    usage of 5 prompt and 2 completion tokens. `submitted` holds every accepted request's
    params, in order; `sent` every command sent without waiting (cancellations).
    """

    def __init__(self, answer: str = SCRIPTED_ANSWER) -> None:
        self.answer = answer
        self.node_id = NodeId("node-a")
        self.cards: dict[str, ModelCard] = {SMOLLM2: smollm2_card()}
        self.state = make_state(instances=[make_instance(self.node_id)])
        self.submitted: list[GenerateText] = []
        self.sent: list[Command] = []
        self.load_on_request = LoadOnRequest()
        self.ready_times = ReadyTimes()  # none seen ready: `load_duration` is measured
        self.stop = NodeStop()  # `ClusterClient.end_streams` begins it
        self.placing: dict[str, anyio.Event] = {}
        self.downloads_recorded: list[tuple[str, DownloadStatus]] = []
        self.generation_aliases: dict[CommandId, CommandId] = {}
        self.waiting_generations: dict[CommandId, anyio.Event] = {}
        self.kv_cache: list[KVCacheUse] = []  # what `local_kv_cache` reports
        self.image_policy = ImagePolicy()  # tests replace it (`allow_private_urls`)
        self.embedding_commands: list[ComputeEmbeddings] = []
        self.rerank_scores: tuple[float, ...] = (0.2, 0.9, 0.5)
        """Document i's score is `rerank_scores[i % len]`."""

    async def wait_until_caught_up(self, timeout: float = 0.0) -> bool:
        """Always caught up: the state is what the test set."""
        return True

    def add_model(self, card: ModelCard) -> None:
        """Know `card` and place an instance of it on this node."""
        self.cards[card.model_id] = card
        instances = list(self.state.instances.values())
        instance_id = f"instance-{len(instances) + 1}"
        self.state = make_state(
            instances=[*instances, make_instance(self.node_id, card, instance_id=instance_id)]
        )

    def local_kv_cache(self) -> list[KVCacheUse]:
        return list(self.kv_cache)

    def record_download(self, model_id: str, status: DownloadStatus) -> None:
        self.downloads_recorded.append((model_id, status))

    @property
    def last_params(self) -> TextGenerationTaskParams:
        """The params of the most recent accepted generation."""
        return self.submitted[-1].params

    async def submit(self, command: GenerateText | ComputeEmbeddings, timeout: float = 0.0) -> None:
        if isinstance(command, ComputeEmbeddings):
            self.embedding_commands.append(command)
        else:
            self.submitted.append(command)

    def send_and_forget(self, command: Command) -> None:
        self.sent.append(command)

    @contextmanager
    def chunk_stream(self, command_id: CommandId) -> Iterator[AsyncIterator[Chunk]]:
        yield self._answer(command_id)

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        embedding = [item for item in self.embedding_commands if item.command_id == command_id]
        if embedding:
            yield self._embedding_answer(embedding[0])
            return
        (command,) = [item for item in self.submitted if item.command_id == command_id]
        yield TokenChunk(
            command_id=command_id,
            model=command.params.model,
            text=self.answer,
            token_ids=(1, 2),
            finish_reason="stop",
            usage=Usage(prompt_tokens=5, completion_tokens=2),
        )

    def _embedding_answer(self, command: ComputeEmbeddings) -> EmbeddingChunk:
        """Input i's vector is the unit vector along axis `i % width` (width: the request's
        `dimensions`, else 4); a rerank's scores are `rerank_scores`; 7 prompt tokens."""
        params = command.params
        count = len(params.inputs)
        if params.kind == "rerank":
            scores = tuple(self.rerank_scores[i % len(self.rerank_scores)] for i in range(count))
            return EmbeddingChunk(
                command_id=command.command_id, model=params.model, scores=scores, prompt_tokens=7
            )
        width = params.dimensions or 4
        vectors = tuple(
            tuple(1.0 if column == row % width else 0.0 for column in range(width))
            for row in range(count)
        )
        return EmbeddingChunk(
            command_id=command.command_id, model=params.model, vectors=vectors, prompt_tokens=7
        )
