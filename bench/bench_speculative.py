"""Speculative decoding with n-gram (prompt lookup) drafts against plain decoding.

Usage: PYTHONPATH=src python bench/bench_speculative.py [--rounds 5] [--tasks copy chat]
       [--modes off on auto] [--models-dir DIR] [--threads N] [--json PATH]
       PYTHONPATH=src python bench/bench_speculative.py --draft-pair [--acceptance 0.5 0.8]
       [--pair-layers N] [--pair-tokens 64] [--rounds 5] [--cores 0 1] [--pair-tiny]

The default model (SmolLM2-135M-Instruct, the engine's default int4 weights) in this
process, greedy, one request at a time:
- copy-edit: the model rewrites a ~400-token passage with one change (a name replaced):
  a reply that copies its prompt, where drafts from the prompt should be accepted;
- chat: a free-form request (a story), where prompt lookup finds few drafts.
Each round runs every mode once per task, in turn (interleaved: the machine's load drifts
alike over all of them); `--rounds` rounds. Per task and mode: decode tok/s ((completion
tokens - 1) / (last piece - first piece), the prefill excluded, the same in every mode), its
median and spread (min-max) over the rounds, the median over rounds of the ratio to the
same round's plain run, tokens per step and the acceptance rate of the drafts, and whether
the text equals plain decoding's (it must, greedy). Modes: `off` (plain), `on` (drafts
wherever found), `auto` (the instance's switch: drafts while measured to help). Targets
(issue 43): copy-edit >= 1.8x plain, chat >= 0.97x plain with `auto`. `--threads` sets
torch's threads (on a machine other processes keep busy, one thread avoids OpenMP's
barrier waits, which inflate every step's cost and so favour fewer, wider steps).

`--draft-pair` measures a draft model's mechanism instead: random-weight models of
SmolLM2-135M's (draft) and SmolLM2-1.7B's (target) shapes, int4 like the engine's default,
the draft loaded beside the target (`--draft-model`'s path). Its drafts are computed (every
draft forward pass runs) and then forced to a chosen acceptance rate (`--acceptance`): the
draft model's greedy token at each position of the text is the target's own greedy token
there with that probability (a fixed seeded draw per position and rate, alike in every
mode), else a wrong one, so the cost of the mechanism is measured apart from a draft's
quality (random models agree on nothing). The forcing is the draft model's own choice
(its KV holds the tokens it drafted), so a draft server's guess of the target's bonus token
is right with that probability too, as a real draft's would be. `--pair-layers N` cuts
both to N layers (a smoke run; the full pair writes ~7.5 GB of float32 weights to a
temporary directory first); `--pair-tiny` uses tiny shapes instead (a smoke run of the
mechanism only).

The draft runs in two places (three modes), interleaved with plain decoding in every round:
- `same@RATE`, draft on the same node: target and draft in this process, pinned to the
  first of `--cores` (one thread), the draft's forward passes in the target's step;
- `remote@RATE`, draft on a second node: the draft in a `DraftServer` in another process
  pinned to the second core (one thread), the target here drafting through the link
  (`remote_drafts.RemoteDraftSource`, over loopback TCP). The two cores stand for two
  nodes' CPUs; the link's own cost (a round trip of a few dozen bytes per step) is in it,
  a LAN's latency is not (add it: about 0.1-0.3 ms a step on gigabit Ethernet). The
  server drafts ahead while the target verifies (`draft_server.py`);
- `serial@RATE`, the same without drafting ahead (`EXO_DRAFT_AHEAD=0`'s server).
Printed per mode: tok/s median and spread (min-max) over the rounds, the median of the
ratio to the same round's plain run, and remote / same per rate (the target: >= 1.0); per
server: what the link carried and, drafting ahead, its hit rate (messages answered from
the guess / messages drafted ahead for) and the positions drafted ahead and abandoned.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir as default_models_dir
from exo.shared.models.cards import card_from_local_directory, load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import (
    ChatMessage,
    SpeculativeMode,
    TextGenerationTaskParams,
)
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.speculation import Speculation
from exo.worker.engines.torch.comm.draft_link import LinkCounters
from exo.worker.engines.torch.decoding.speculative_drafts import Draft, DraftRequest
from exo.worker.engines.torch.decoding.speculative_policy import SpeculationSettings
from exo.worker.engines.torch.draft_model import DraftModelSource
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.remote_drafts import (
    RemoteDraft,
    RemoteDraftSource,
    load_draft_server,
    vocabulary_fingerprint,
)

MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
MODES: dict[str, SpeculativeMode] = {"off": False, "on": True, "auto": "auto"}

PASSAGE = (
    "Margaret Hale had lived in the village of Helstone for most of her childhood, and she "
    "knew every lane and hedgerow that wound between the parsonage and the forest. In the "
    "spring the banks were thick with primroses and violets, and the air smelled of damp "
    "earth and woodsmoke. Her father, the vicar, walked the same path each morning to the "
    "church, nodding to the labourers who were already in the fields. The cottages were "
    "small and their thatched roofs sagged, but the gardens in front of them were bright "
    "with hollyhocks and sweet peas. Margaret often stopped to talk with old Betty Higgins, "
    "who sat at her door knitting stockings for her grandchildren and told stories of the "
    "great storm that had flattened the mill forty years before. When autumn came the "
    "beech trees turned to copper and gold, and the children gathered nuts and blackberries "
    "along the edge of the common. In the evenings the family sat by the fire in the small "
    "drawing room, her mother sewing, her father reading aloud from a book of sermons or a "
    "volume of poetry, and Margaret listening with her chin in her hands. She could not "
    "imagine a life anywhere else. Then one winter evening her father came home pale and "
    "silent, and after supper he told them that he had resigned his living and that they "
    "would be leaving Helstone for Milton, a manufacturing town in the north, where the "
    "air was thick with smoke from the cotton mills and the streets were crowded with "
    "workers. Her mother wept, and Margaret sat very still, watching the fire burn down to "
    "ashes while the wind moved in the trees outside the window."
)
TASKS = {
    "copy": (
        "Rewrite the following passage exactly as it is, word for word, except that the "
        f"name Margaret becomes Eleanor everywhere:\n\n{PASSAGE}",
        520,
    ),
    "chat": ("Write a short story about a fox who learns to play the violin.", 200),
}


def speculation(engine: TorchEngine) -> Speculation:
    """The engine's single-rank speculation (drafts, counters, switch)."""
    found = engine.scheduler.speculation
    assert found is not None
    return found


def load_engine(models_dir: Path) -> TorchEngine:
    card = load_builtin_cards()[MODEL]
    directory = prepare_model(card, models_dir, offline=False)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(directory, shard, speculation=SpeculationSettings(default="auto"))
    engine.warmup()
    return engine


def run_once(engine: TorchEngine, prompt: str, max_tokens: int, mode: str) -> dict[str, Any]:
    """One greedy request: its text, decode tok/s and what its drafts did."""
    params = TextGenerationTaskParams(
        model=MODEL, messages=(ChatMessage(role="user", content=prompt),),
        max_tokens=max_tokens, temperature=0.0, speculative=MODES[mode],
    )  # fmt: skip
    before = dataclasses.replace(speculation(engine).counters)
    times: list[float] = []
    text = ""
    completion = 0
    for piece in engine.generate(params):
        times.append(time.perf_counter())
        text += piece.text
        if piece.usage is not None:
            completion = piece.usage.completion_tokens
    after = speculation(engine).counters
    rounds = after.decode_rounds - before.decode_rounds
    drafted = after.drafted_tokens - before.drafted_tokens
    return {
        "text": text,
        "completion_tokens": completion,
        "decode_tok_s": (completion - 1) / (times[-1] - times[0]),
        "tokens_per_step": (after.decode_tokens - before.decode_tokens) / max(rounds, 1),
        "acceptance": (after.accepted_tokens - before.accepted_tokens) / drafted
        if drafted
        else None,
        "auto_enabled": speculation(engine).auto_switch.enabled,
    }


# SmolLM2's shapes (their config.json files): hidden, MLP, layers, heads, KV heads.
PAIR_SHAPES = {
    "draft": {"hidden_size": 576, "intermediate_size": 1536, "n_layers": 30,
              "num_attention_heads": 9, "num_key_value_heads": 3},
    "target": {"hidden_size": 2048, "intermediate_size": 8192, "n_layers": 24,
               "num_attention_heads": 32, "num_key_value_heads": 32},
}  # fmt: skip


class Forcing:
    """Forces a draft model's greedy token at each position of the text to the target's
    plain greedy token there (`reference`) with probability `rate`, else to another token:
    a fixed seeded draw per position and rate (`keeps`), the same in every process and
    mode. Installed on a `DraftModelSource` by `install` (its forward passes still run)."""

    def __init__(self, reference: list[int], vocab: int, rate: float) -> None:
        self.reference = reference
        self.vocab = vocab
        self.rate = rate
        self._keeps: dict[float, list[bool]] = {}

    def keeps(self, rate: float) -> list[bool]:
        if rate not in self._keeps:
            draws = random.Random(round(rate * 1e6))
            self._keeps[rate] = [draws.random() < rate for _ in self.reference]
        return self._keeps[rate]

    def install(self, source: DraftModelSource) -> None:
        original = source._choose

        def choose(request: DraftRequest, sequence: Any, logits: torch.Tensor) -> Any:
            token, distribution = original(request, sequence, logits)
            position = len(sequence.tokens)  # the chosen token's: its feed is in `tokens`
            if position >= len(self.reference):
                return token, distribution
            right = self.reference[position]
            return (right if self.keeps(self.rate)[position] else (right + 1) % self.vocab), None

        setattr(source, "_choose", choose)  # noqa: B010 (an instance's method, replaced)


class Timed:
    """Wraps a draft source, timing its `propose` (the drafting's cost on rank 0's step)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    @property
    def name(self) -> str:
        return str(self.inner.name)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        started = time.perf_counter()
        drafts: list[Draft] = self.inner.propose(requests)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return drafts

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)


# The instance id the bench's draft server and target agree on (no secret: loopback).
PAIR_INSTANCE = "bench-draft-pair"


def pin(core: int) -> None:
    """Run this process (and the threads it starts) on `core` alone, torch on one thread."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def serve_draft(directory: Path, core: int, setup: Any, results: Any, stop: Any) -> None:
    """The second node: one draft server per (rate, drafting ahead or not) on `core`, its
    draft forced (`Forcing`) to the rate; takes (reference, vocab, rates) from `setup`, puts
    {mode: port} on `results`, serves until `stop`, then puts {mode: counters} there."""
    pin(core)
    reference, vocab, rates = setup.get()
    servers = {}
    for rate in rates:
        for mode, ahead in (("remote", True), ("serial", False)):
            server = load_draft_server(directory, 0, None, PAIR_INSTANCE, 1, None)
            server.draft_ahead = ahead
            assert isinstance(server.source, DraftModelSource)
            Forcing(reference, vocab, rate).install(server.source)
            server.start()
            servers[f"{mode}@{rate}"] = server
    results.put({mode: server.port for mode, server in servers.items()})
    stop.wait()
    counters = {}
    for mode, server in servers.items():
        server.close()
        counters[mode] = {
            "link": dataclasses.asdict(server.counters),
            "ahead": dataclasses.asdict(server.ahead),
        }
    results.put(counters)


def pair_directories(args: argparse.Namespace, scratch: Path) -> dict[str, Path]:
    """The draft and target checkpoints (random weights, SmolLM2's tokenizer)."""
    card = load_builtin_cards()[MODEL]
    tokenizer_dir = prepare_model(card, args.models_dir, offline=False)
    directories = {}
    for role, shape in PAIR_SHAPES.items():
        overrides: dict[str, Any] = dict(shape)
        layers = int(overrides.pop("n_layers"))
        if args.pair_tiny:
            overrides, layers = {}, 2 if role == "draft" else 4
        directories[role] = save_tiny_model(
            scratch / role, "llama", tokenizer_dir, n_layers=args.pair_layers or layers,
            max_position_embeddings=2048, **overrides,
        )  # fmt: skip
    return directories


def draft_pair(args: argparse.Namespace) -> None:
    """`--draft-pair` (see the module docstring)."""
    target_core, draft_core = args.cores
    with tempfile.TemporaryDirectory(prefix="exo-draft-pair-") as scratch:
        directories = pair_directories(args, Path(scratch))
        context = multiprocessing.get_context("spawn")
        setup, results, stop = context.Queue(), context.Queue(), context.Event()
        server = context.Process(
            target=serve_draft, args=(directories["draft"], draft_core, setup, results, stop),
            daemon=True,
        )  # fmt: skip
        server.start()
        pin(target_core)
        target_card = card_from_local_directory(directories["target"])
        shard = ShardMetadata(
            sharding="pipeline", model_card=target_card, device_rank=0, world_size=1,
            start_layer=0, end_layer=target_card.n_layers,
        )  # fmt: skip
        engine = TorchEngine.load(
            directories["target"], shard, speculation=SpeculationSettings(default=True),
            draft_model=directories["draft"],
        )  # fmt: skip
        engine.eos_token_ids = frozenset({-1})  # random weights: the length ends the reply
        engine.warmup()
        local = engine.draft_source
        assert isinstance(local, DraftModelSource)
        reference = plain_reference(engine, args.pair_tokens)
        forcing = Forcing(reference, engine.vocab_size, args.acceptance[0])
        forcing.install(local)
        setup.put((reference, engine.vocab_size, list(args.acceptance)))
        ports = results.get(timeout=900)
        remotes = {
            mode: RemoteDraftSource(
                RemoteDraft("127.0.0.1", port, "draft", None, PAIR_INSTANCE),
                vocabulary_fingerprint(engine.tokenizer), engine.vocab_size,
            )
            for mode, port in ports.items()
        }  # fmt: skip
        try:
            for remote in remotes.values():
                if not remote.wait_connected(30):
                    raise RuntimeError("a draft server did not accept the bench's connection")
            measure_pair(args, engine, local, forcing, remotes)
        finally:
            for remote in remotes.values():
                remote.close()
            stop.set()
            served = results.get(timeout=60)
            server.join(30)
        for mode, remote in remotes.items():
            link_report(mode, remote.counters, served[mode])


def plain_reference(engine: TorchEngine, max_tokens: int) -> list[int]:
    """The chat task's prompt and plain greedy reply, token ids."""
    state = engine.build_request(
        TextGenerationTaskParams(
            model=MODEL, messages=(ChatMessage(role="user", content=TASKS["chat"][0]),),
            max_tokens=max_tokens, temperature=0.0, speculative=False,
        )
    )  # fmt: skip
    engine.scheduler.add(state)
    while engine.has_work:
        engine.step()
    engine.store_finished()
    return state.prompt_ids + state.generated_ids


def link_report(mode: str, client: LinkCounters, server: dict[str, Any]) -> None:
    """What the link carried per round trip, and its time: the client's round trip less the
    server's drafting is the link's cost (TCP, both processes' wake-ups, framing); drafting
    ahead, its hit rate."""
    trips = client.round_trips
    if not trips:
        return
    link, ahead = server["link"], server["ahead"]
    print(
        f"{mode}: {trips} round trips, {client.bytes_sent / trips:.1f} B up and "
        f"{client.bytes_received / trips:.1f} B down per round trip, "
        f"{client.tokens_sent / trips:.2f} tokens up and {client.tokens_received / trips:.2f} "
        f"down; {1e3 * client.seconds / trips:.2f} ms a round trip, of which the server "
        f"drafted {1e3 * link['seconds'] / max(link['round_trips'], 1):.2f} ms"
    )
    guessed = ahead["hits"] + ahead["misses"]
    if guessed:
        print(
            f"{mode}: drafting ahead hit {ahead['hits']} of {guessed} guesses "
            f"({ahead['hits'] / guessed:.0%}; {ahead['hits'] / link['round_trips']:.0%} of "
            f"round trips), {ahead['positions']} positions drafted ahead, "
            f"{ahead['abandoned']} abandoned, {ahead['interrupted']} stopped by a message"
        )


def measure_pair(
    args: argparse.Namespace,
    engine: TorchEngine,
    local: DraftModelSource,
    forcing: Forcing,
    remotes: dict[str, RemoteDraftSource],
) -> None:
    """Interleaved rounds of plain decoding and each source at each forced acceptance."""
    prompt, max_tokens = TASKS["chat"][0], args.pair_tokens
    plain = run_once(engine, prompt, max_tokens, "off")
    original = speculation(engine).source
    speeds: dict[str, list[float]] = {"off": []}
    speeds |= {f"{where}@{rate}": [] for rate in args.acceptance
               for where in ("same", "remote", "serial")}  # fmt: skip
    drafting: dict[str, list[float]] = {mode: [] for mode in speeds if mode != "off"}
    for round_index in range(args.rounds):
        for mode in speeds:
            if mode == "off":
                result = run_once(engine, prompt, max_tokens, "off")
            else:
                where, rate = mode.split("@")
                forcing.rate = float(rate)
                timed = Timed(local if where == "same" else remotes[mode])
                speculation(engine).source = timed
                try:
                    result = run_once(engine, prompt, max_tokens, "on")
                finally:
                    speculation(engine).source = original
                drafting[mode].append(1e3 * timed.seconds / max(timed.calls, 1))
                assert result["text"] == plain["text"], "greedy output changed"
            speeds[mode].append(result["decode_tok_s"])
            print(
                f"round {round_index + 1} {mode:12s} {result['decode_tok_s']:7.1f} tok/s "
                f"{result['tokens_per_step']:.2f} tok/step",
                flush=True,
            )
    print(f"\n{'mode':12s} {'tok/s median':>12s} {'spread':>15s} {'x plain':>8s}")
    for mode, values in speeds.items():
        ratios = [value / base for value, base in zip(values, speeds["off"], strict=True)]
        print(
            f"{mode:12s} {statistics.median(values):12.1f} "
            f"{min(values):7.1f}-{max(values):<7.1f} {statistics.median(ratios):8.2f}"
        )
    for mode, values in drafting.items():
        print(f"{mode}: {statistics.median(values):.2f} ms a step proposing (median of rounds)")
    for rate in args.acceptance:
        for where in ("remote", "serial"):
            pairs = zip(speeds[f"{where}@{rate}"], speeds[f"same@{rate}"], strict=True)
            ratios = [remote / same for remote, same in pairs]
            print(
                f"{where} / same at acceptance {rate}: median {statistics.median(ratios):.2f} "
                f"(spread {min(ratios):.2f}-{max(ratios):.2f}; target >= 1.0)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["copy", "chat"])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--models-dir", type=Path, default=default_models_dir())
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--draft-pair", action="store_true")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.8])
    parser.add_argument("--pair-layers", type=int, default=None)
    parser.add_argument("--pair-tokens", type=int, default=64)
    parser.add_argument("--pair-tiny", action="store_true")
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1])
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.draft_pair:
        draft_pair(args)
        return
    modes = ["off", *(mode for mode in args.modes if mode != "off")]
    engine = load_engine(args.models_dir)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        task: {mode: [] for mode in modes} for task in args.tasks
    }
    for round_index in range(args.rounds):
        for task in args.tasks:
            prompt, max_tokens = TASKS[task]
            for mode in modes:
                result = run_once(engine, prompt, max_tokens, mode)
                results[task][mode].append(result)
                print(
                    f"round {round_index + 1} {task:5s} {mode:4s} "
                    f"{result['decode_tok_s']:7.1f} tok/s  {result['completion_tokens']} tokens "
                    f"{result['tokens_per_step']:.2f} tok/step",
                    flush=True,
                )
    summary: dict[str, Any] = {}
    print(
        f"\n{'task':6s} {'mode':5s} {'tok/s median':>12s} {'spread':>15s} {'x plain':>8s} "
        f"{'tok/step':>8s} {'accepted':>8s} same-text"
    )
    for task in args.tasks:
        plain = results[task]["off"]
        for mode in modes:
            runs = results[task][mode]
            speeds = [run["decode_tok_s"] for run in runs]
            ratios = [
                run["decode_tok_s"] / base["decode_tok_s"]
                for run, base in zip(runs, plain, strict=True)
            ]
            acceptances = [run["acceptance"] for run in runs if run["acceptance"] is not None]
            same = all(run["text"] == base["text"] for run, base in zip(runs, plain, strict=True))
            row = {
                "median_tok_s": statistics.median(speeds),
                "min_tok_s": min(speeds),
                "max_tok_s": max(speeds),
                "median_ratio": statistics.median(ratios),
                "ratio_spread": (min(ratios), max(ratios)),
                "tokens_per_step": statistics.median(run["tokens_per_step"] for run in runs),
                "acceptance": statistics.median(acceptances) if acceptances else None,
                "same_text": same,
            }
            summary[f"{task}/{mode}"] = row
            accepted = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
            print(
                f"{task:6s} {mode:5s} {row['median_tok_s']:12.1f} "
                f"{row['min_tok_s']:7.1f}-{row['max_tok_s']:<7.1f} {row['median_ratio']:8.2f} "
                f"{row['tokens_per_step']:8.2f} {accepted:>8s} {same}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
