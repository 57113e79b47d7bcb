"""What the speculative decoding tests build and run: requests, a tiny engine that drafts
from any source, `ScriptedDrafts` (plain decoding's continuation with deliberate
mistakes), each request's plain reference, a bigram "model" with a bare request state and
a chi-square test for the acceptance rule's distribution, and a tiny target with noisy
copies of it as draft models."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.chunks import TokenLogprob
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.request_state import GeneratedPiece, RequestState
from exo.worker.engines.torch.batching.speculation import Speculation
from exo.worker.engines.torch.decoding.detokenizer import StreamingDetokenizer
from exo.worker.engines.torch.decoding.sampling import Sampler, TokenChooser, step_logprobs
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.decoding.speculative_drafts import Draft, DraftRequest
from exo.worker.engines.torch.decoding.stop_sequences import StopSequenceMatcher
from exo.worker.engines.torch.draft_model import DraftModelSource
from exo.worker.engines.torch.engine import TorchEngine

PROMPTS = ("Tell me a story about a dragon", "Hi", "Count: one two three four five")


def speculation(engine: TorchEngine) -> Speculation:
    """The engine's single-rank speculation (drafts, counters, switch)."""
    found = engine.scheduler.speculation
    assert found is not None
    return found


def request(content: str, **fields: Any) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content=content),), **fields
    )


class BigramModel:
    """A small-vocabulary "model": the next token's logits depend on the last token only
    (`table[last]`), so the target distribution of a sequence is known exactly."""

    def __init__(self, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=generator) * 1.5  # [last, next]

    def rows(self, fed: int, draft: Sequence[int]) -> torch.Tensor:
        """The verify step's logits: after `fed`, then after each draft token."""
        return self.table[[fed, *draft]]


def bare_state(params: SamplingParams, max_tokens: int = 2) -> RequestState:
    """A request of a one-token prompt over `BigramModel`'s vocabulary (tokens as "<i>")."""
    return RequestState(
        request_id="r",
        prompt_ids=[0],
        max_new_tokens=max_tokens,
        chooser=TokenChooser(Sampler(params)),
        top_logprobs=0,
        detokenizer=StreamingDetokenizer(lambda ids: "".join(f"<{i}>" for i in ids), [0]),
        stop_matcher=StopSequenceMatcher(()),
        eos_token_ids=frozenset(),
        logprob_of=lambda logits, token, top: TokenLogprob(
            token=f"<{token}>",
            token_id=token,
            logprob=step_logprobs(cast(torch.Tensor, logits), token, top).logprob,
        ),
    )


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Upper tail of Pearson's chi-square (Wilson-Hilferty normal approximation)."""
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    freedom = sum(1 for e in expected if e > 0) - 1
    z = ((statistic / freedom) ** (1 / 3) - (1 - 2 / (9 * freedom))) / math.sqrt(2 / (9 * freedom))
    return 0.5 * math.erfc(z / math.sqrt(2))


class ScriptedDrafts:
    """Proposes the continuation plain decoding produced for each request (`reference`:
    request id -> its prompt and generated tokens), with a wrong token at index
    `round % 3` of every draft whose round number is not a multiple of 3 (round 0, 3, ...:
    all correct), so drafts are accepted whole, cut at their first token and cut later."""

    def __init__(self, reference: dict[str, list[int]], vocab: int) -> None:
        self.reference = reference
        self.vocab = vocab
        self.rounds = 0
        self.forgotten: list[str] = []

    @property
    def name(self) -> str:
        return "scripted"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for wanted in requests:
            expected = self.reference[wanted.request_id]
            assert list(wanted.tokens) == expected[: len(wanted.tokens)], "text diverged"
            draft = expected[len(wanted.tokens) : len(wanted.tokens) + wanted.max_tokens]
            if draft and self.rounds % 3:
                wrong = min(self.rounds % 3 - 1, len(draft) - 1)
                draft[wrong] = (draft[wrong] + 1) % self.vocab
            self.rounds += 1
            drafts.append(Draft(tuple(draft)))
        return drafts

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def run(engine: TorchEngine, states: list[RequestState], join_at: list[int]) -> dict[str, Any]:
    """Submit `states[i]` before step `join_at[i]`; step until all finish."""
    pieces: dict[str, list[GeneratedPiece]] = {state.request_id: [] for state in states}
    for step in range(1_000):
        for state, join in zip(states, join_at, strict=True):
            if join == step:
                engine.scheduler.add(state)
        for request_id, output in engine.step():
            assert isinstance(output, GeneratedPiece), (request_id, output)
            pieces[request_id].append(output)
        if step >= max(join_at) and not engine.has_work:
            engine.store_finished()
            return pieces
    raise AssertionError("the batch did not finish within 1,000 steps")


def plain_references(
    engine: TorchEngine, params: list[TextGenerationTaskParams]
) -> dict[str, list[int]]:
    """Each request alone, without drafts: request id -> prompt and generated tokens."""
    reference: dict[str, list[int]] = {}
    for index, one in enumerate(params):
        engine.clear_prefix_cache()
        state = engine.build_request(
            one.model_copy(update={"speculative": False}), None, f"r{index}"
        )
        run(engine, [state], [0])
        reference[f"r{index}"] = state.prompt_ids + state.generated_ids
    engine.clear_prefix_cache()
    return reference


def load(directory: Path, **options: Any) -> TorchEngine:
    card = card_from_local_directory(directory)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    options.setdefault("weight_dtype", "float32")
    engine = TorchEngine.load(directory, shard, **options)
    engine.eos_token_ids = frozenset({-1})  # random weights: stop by length or stop string
    speculation(engine).step_cost = lambda rows: None  # draft lengths never follow the clock
    return engine


# Noise (standard deviation) added to every weight of the target for the draft: with it the
# tiny draft's greedy tokens agree with the target's about a third of the time.
DRAFT_NOISE = 0.003


def noisy_copy(target: Path, directory: Path, noise: float, layers: int | None = None) -> Path:
    """The target's checkpoint with seeded noise on every tensor (and only its first
    `layers` decoder layers, where given)."""
    shutil.copytree(target, directory)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, tensor in load_file(target / "model.safetensors").items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layers is not None and layer >= layers:
            continue
        tensors[name] = tensor + noise * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    if layers is not None:
        config = json.loads((directory / "config.json").read_text())
        config["num_hidden_layers"] = layers
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def draft_model_dirs(root: Path, real_model_dir: Path) -> dict[str, Path]:
    """Under `root`: a tiny random Llama target (3 layers, untied embeddings: a tied one
    repeats its input token, which any draft guesses), its `noisy_copy` as "draft", and
    its first layer alone without noise as "smaller"."""
    target = save_tiny_model(
        root / "target", "llama", real_model_dir, n_layers=3, tie_word_embeddings=False
    )
    return {
        "target": target,
        "draft": noisy_copy(target, root / "draft", DRAFT_NOISE),
        "smaller": noisy_copy(target, root / "smaller", 0.0, layers=1),
    }


def draft_source(engine: TorchEngine) -> DraftModelSource:
    source = speculation(engine).source
    assert isinstance(source, DraftModelSource)
    return source
