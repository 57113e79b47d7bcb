from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.engine import GeneratedPiece, TorchEngine
from exo.worker.engines.torch.engine_factory import load_engine
from exo.worker.engines.torch.engine_requests import PromptTooLongError


def request(content: str, model: str = "m", **fields: Any) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId(model), messages=(ChatMessage(role="user", content=content),), **fields
    )


def check_stream_shape(pieces: list[GeneratedPiece]) -> None:
    assert pieces, "a generation yields at least its final piece"
    for piece in pieces[:-1]:
        assert piece.finish_reason is None and piece.usage is None
    assert pieces[-1].finish_reason is not None
    assert pieces[-1].usage is not None


# --- tiny random-weight model ------------------------------------------------------------


def test_tiny_loading_reports_every_layer(tiny_card: ModelCard, tiny_model_dir: Path) -> None:
    progress: list[tuple[int, int]] = []
    shard = ShardMetadata(
        sharding="tensor",
        model_card=tiny_card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=tiny_card.n_layers,
    )
    TorchEngine.load(tiny_model_dir, shard, on_layer_loaded=lambda a, b: progress.append((a, b)))
    assert progress == [(0, 2), (1, 2), (2, 2)]


def test_tiny_weights_equal_transformers_loading(
    tiny_engine: TorchEngine, tiny_model_dir: Path
) -> None:
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ours = dict(tiny_engine.model.named_parameters())
    for name, parameter in reference.named_parameters():
        assert torch.equal(ours[name], parameter), name
    output_embeddings: Any = tiny_engine.model.get_output_embeddings()
    input_embeddings: Any = tiny_engine.model.get_input_embeddings()
    assert output_embeddings.weight.data_ptr() == input_embeddings.weight.data_ptr()


def test_tiny_greedy_matches_transformers_generate(
    tiny_engine: TorchEngine, tiny_model_dir: Path
) -> None:
    params = request("Hello there", temperature=0.0, max_tokens=12)
    pieces = list(tiny_engine.generate(params))
    check_stream_shape(pieces)
    ours = [token for piece in pieces for token in piece.token_ids]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = torch.tensor([tiny_engine.encode_prompt(params.messages)])
    with torch.inference_mode():
        expected = reference.generate(
            prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, prompt.shape[1] :].tolist()
    stop_at = next(
        (i for i, token in enumerate(expected) if token in tiny_engine.eos_token_ids), None
    )
    assert ours == expected[:stop_at]


def test_tiny_max_tokens_gives_length(tiny_engine: TorchEngine) -> None:
    tiny_engine.eos_token_ids = frozenset({-1})  # random weights: never stop early
    pieces = list(tiny_engine.generate(request("Count", temperature=1.0, seed=3, max_tokens=9)))
    check_stream_shape(pieces)
    final = pieces[-1]
    assert final.finish_reason == "length"
    assert final.usage is not None and final.usage.completion_tokens == 9
    assert sum(len(piece.token_ids) for piece in pieces) == 9


def test_tiny_context_limit_gives_length(tiny_engine: TorchEngine) -> None:
    tiny_engine.eos_token_ids = frozenset({-1})
    params = request("Fill the context", temperature=0.0)
    prompt_tokens = tiny_engine.count_prompt_tokens(params)
    final = list(tiny_engine.generate(params))[-1]
    assert final.finish_reason == "length"
    assert final.usage is not None
    assert final.usage.prompt_tokens + final.usage.completion_tokens == 256
    assert final.usage.prompt_tokens == prompt_tokens


def test_a_requests_context_bounds_prompt_and_reply(tiny_engine: TorchEngine) -> None:
    # Ollama's num_ctx (`context_tokens`): below the model's 256 tokens it is the limit.
    tiny_engine.eos_token_ids = frozenset({-1})
    params = request("Fill the context", temperature=0.0, context_tokens=40)
    final = list(tiny_engine.generate(params))[-1]
    assert final.finish_reason == "length" and final.usage is not None
    assert final.usage.prompt_tokens + final.usage.completion_tokens == 40
    with pytest.raises(PromptTooLongError, match="the request's context is 4 tokens"):
        next(tiny_engine.generate(request("word " * 10, context_tokens=4)))
    # Above the model's context it changes nothing.
    final = list(tiny_engine.generate(request("Fill", temperature=0.0, context_tokens=9999)))[-1]
    assert final.usage is not None
    assert final.usage.prompt_tokens + final.usage.completion_tokens == 256


def test_tiny_prompt_too_long(tiny_engine: TorchEngine) -> None:
    with pytest.raises(PromptTooLongError, match="context is 256 tokens"):
        next(tiny_engine.generate(request("word " * 400)))


def test_tiny_closing_generator_frees_kv_cache(tiny_engine: TorchEngine) -> None:
    tiny_engine.eos_token_ids = frozenset({-1})
    generator = tiny_engine.generate(request("Go on", temperature=1.0, seed=1, max_tokens=50))
    next(generator)
    assert tiny_engine.has_work and tiny_engine.scheduler.kv_tokens() > 0
    generator.close()
    assert not tiny_engine.has_work and tiny_engine.scheduler.kv_tokens() == 0
    # The engine serves the next request normally.
    final = list(tiny_engine.generate(request("Again", temperature=0.0, max_tokens=3)))[-1]
    assert final.usage is not None and final.usage.completion_tokens == 3


def test_multi_rank_shard_needs_a_process_group(tiny_card: ModelCard, tiny_model_dir: Path) -> None:
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=tiny_card,
        device_rank=0,
        world_size=2,
        start_layer=0,
        end_layer=1,
    )
    with pytest.raises(RuntimeError, match="init_group"):
        load_engine(tiny_model_dir, shard)
    with pytest.raises(RuntimeError, match="init_group"):  # one engine: the same check
        TorchEngine.load(tiny_model_dir, shard)


# --- the real default model ---------------------------------------------------------------


def test_real_greedy_answer_is_paris(real_engine: TorchEngine) -> None:
    pieces = list(
        real_engine.generate(
            request("What is the capital of France?", temperature=0.0, max_tokens=30)
        )
    )
    check_stream_shape(pieces)
    text = "".join(piece.text for piece in pieces)
    assert "Paris" in text
    assert pieces[-1].finish_reason == "stop"
    assert sum(1 for piece in pieces if piece.text) >= 5  # streamed, not one blob


def test_real_same_seed_same_text(real_engine: TorchEngine) -> None:
    # Both runs cold (a seeded request sent cold and prefix-cached: test_seeded_paths.py).
    params = request("Write a short poem about the sea.", temperature=1.0, seed=42, max_tokens=24)
    real_engine.clear_prefix_cache()
    first = "".join(piece.text for piece in real_engine.generate(params))
    real_engine.clear_prefix_cache()
    second = "".join(piece.text for piece in real_engine.generate(params))
    other = "".join(
        piece.text for piece in real_engine.generate(params.model_copy(update={"seed": 7}))
    )
    assert first == second
    assert first != other


def test_real_max_tokens_finish_length(real_engine: TorchEngine) -> None:
    params = request("Tell me a long story about a dragon.", temperature=0.0, max_tokens=10)
    final = list(real_engine.generate(params))[-1]
    assert final.finish_reason == "length"
    assert final.usage is not None and final.usage.completion_tokens == 10


def test_real_stop_string_is_not_emitted(real_engine: TorchEngine) -> None:
    params = request(
        "What is the capital of France?", temperature=0.0, max_tokens=30, stop=("Paris",)
    )
    pieces = list(real_engine.generate(params))
    text = "".join(piece.text for piece in pieces)
    assert pieces[-1].finish_reason == "stop"
    assert "Paris" not in text
    assert text.startswith("The capital of France is")
