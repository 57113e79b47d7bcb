"""Cost of one streamed token between the runner and the API, engine and HTTP left out.

A writer thread plays the runner: every `--period-ms` it sends one step's output (a
`ChunkReport` per request, `--requests` of them, as one pipe message) over a real
`multiprocessing` pipe. A real `RunnerSupervisor` relays it into a started `NetworkRouter`
whose node owns the commands, and the test reads every chunk from the router's chunk
subscription, as the API's cluster client does. Prints the latency from the writer's send
to the chunk's arrival (median / p90, microseconds) and the process CPU time per token
(every thread: the writer's JSON encoding, the supervisor's reader thread, the loop, the
router), and writes JSON (`--json`).

    python bench/bench_chunk_relay.py [--tokens 2000] [--requests 1] [--period-ms 8] [--json out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from multiprocessing import Pipe
from typing import Any

import anyio

from exo.routing.zenoh_router import NetworkRouter
from exo.shared.types.chunks import TokenChunk
from exo.shared.types.common import InstanceId, ModelId, RunnerId
from exo.testing.builders import make_shard, make_text_generation_task
from exo.testing.ports import free_port
from exo.worker.runner.messages import ChunkReport, RunnerOutbound, encode_outbound
from exo.worker.runner.supervisor import RunnerSupervisor

MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")


async def measure(tokens: int, requests: int, period_s: float) -> dict[str, Any]:
    port = free_port()
    router = NetworkRouter(
        "bench-node",
        f"bench-relay-{port}",
        zenoh_port=port,
        listen_host="127.0.0.1",
        multicast=False,
    )
    subscription = router.chunks.subscribe()
    supervisor = RunnerSupervisor(
        node_id=router.node_id,
        runner_id=RunnerId("bench-runner"),
        instance_id=InstanceId("bench-instance"),
        shard=make_shard(),
        emit_event=lambda _event: None,
        publish_chunk=router.chunks.publish_to,
        on_change=lambda: None,
    )
    read, write = Pipe(duplex=False)
    supervisor._from_runner = read  # what start() sets, without spawning a runner
    to_runner_read, supervisor._to_runner = Pipe(duplex=False)  # the tasks land there, unread
    tasks = [
        make_text_generation_task(task_id=f"task-{index}", origin_node_id=router.node_id)
        for index in range(requests)
    ]
    for task in tasks:
        supervisor.send(task)
    steps = max(1, tokens // requests)

    def play_runner() -> None:
        for step in range(steps):
            sent_at = repr(time.perf_counter())
            batch: list[RunnerOutbound] = [
                ChunkReport(
                    chunk=TokenChunk(
                        command_id=task.command_id, model=MODEL, text=sent_at, token_ids=(step,)
                    )
                )
                for task in tasks
            ]
            write.send_bytes(encode_outbound(batch))
            time.sleep(period_s)

    latencies: list[float] = []
    async with router, anyio.create_task_group() as group:
        group.start_soon(supervisor.run)
        await anyio.sleep(0.5)
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        writer = threading.Thread(target=play_runner, daemon=True)
        writer.start()
        with anyio.fail_after(steps * period_s * 4 + 60):
            for _ in range(steps * requests):
                chunk = await subscription.receive()
                assert isinstance(chunk, TokenChunk)
                latencies.append(time.perf_counter() - float(chunk.text))
        cpu, wall = time.process_time() - cpu_start, time.perf_counter() - wall_start
        writer.join()
        supervisor._stopping = True  # the pipe's end below is a shutdown, not a crash
        write.close()
    to_runner_read.close()
    latencies.sort()
    count = len(latencies)
    return {
        "tokens": count,
        "requests": requests,
        "period_ms": period_s * 1e3,
        "latency_median_us": statistics.median(latencies) * 1e6,
        "latency_p90_us": latencies[int(0.9 * (count - 1))] * 1e6,
        "cpu_per_token_us": cpu / count * 1e6,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=1, help="requests per runner step")
    parser.add_argument("--period-ms", type=float, default=8.0, help="time between steps")
    parser.add_argument("--json", help="write the figures to this file")
    arguments = parser.parse_args()
    result = anyio.run(measure, arguments.tokens, arguments.requests, arguments.period_ms / 1e3)
    print(
        f"runner pipe -> API chunk subscription, {result['tokens']} tokens, "
        f"{result['requests']} request(s) per step: latency median "
        f"{result['latency_median_us']:.0f} us, p90 {result['latency_p90_us']:.0f} us; "
        f"CPU {result['cpu_per_token_us']:.0f} us per token"
    )
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(result, file, indent=2)


if __name__ == "__main__":
    main()
