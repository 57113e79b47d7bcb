"""Cards of custom models, built from a local directory and from the Hub (the loopback test
server), and every refusal."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from exo.download.custom_cards import (
    CustomModelError,
    card_for_hub_repository,
    card_for_local_directory,
    template_traits,
)
from exo.download.hub_search import search_hub
from exo.shared.models.architectures import ENGINE_ARCHITECTURES
from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.models import HuggingFaceSource
from exo.testing.hf_server import HubServer
from exo.testing.processes import free_port
from exo.testing.tiny_kimi import save_tiny_kimi_checkout
from exo.testing.tiny_models import save_tiny_checkout

SUPPORTED = ENGINE_ARCHITECTURES
REPO = "someone/tiny-llama"
SHARDED_REPO = "someone/tiny-qwen3-sharded"
GATED_REPO = "someone/tiny-gated"
CUSTOM_CODE_REPO = "someone/tiny-custom-code"
FOREIGN_REPO = "someone/tiny-foreign"
KIMI_REPO = "someone/tiny-kimi-k2"
TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkouts")
    save_tiny_kimi_checkout(root / "kimi")
    return {
        KIMI_REPO: root / "kimi",
        REPO: save_tiny_checkout(root / "llama"),
        SHARDED_REPO: save_tiny_checkout(
            root / "qwen3", "qwen3", chat_template=None, shards=2, n_layers=3
        ),
        CUSTOM_CODE_REPO: save_tiny_checkout(
            root / "custom",
            config_update={"auto_map": {"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}},
        ),
        FOREIGN_REPO: save_tiny_checkout(
            root / "foreign", config_update={"architectures": ["FalconForCausalLM"]}
        ),
    }


@pytest.fixture(scope="module")
def hub(checkouts: dict[str, Path]) -> Iterator[HubServer]:
    with HubServer() as server:
        for repo_id, directory in checkouts.items():
            server.add_directory(repo_id, directory)
        server.add_directory(GATED_REPO, checkouts[REPO], gated="manual", tokens={TOKEN})
        yield server


@pytest.fixture
def hub_env(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    return hub


def refusal(call: object, *args: object) -> CustomModelError:
    assert callable(call)
    with pytest.raises(CustomModelError) as caught:
        call(*args)
    return caught.value


def test_a_local_directory_card_adds_what_its_template_shows(checkouts: dict[str, Path]) -> None:
    directory = checkouts[REPO]
    card = card_for_local_directory(str(directory), SUPPORTED, trust_remote_code=False)
    plain = card_from_local_directory(directory)
    assert card.model_id == plain.model_id == str(directory)
    assert card.parameter_count == plain.parameter_count
    assert card.architecture == "LlamaForCausalLM"
    assert card.has_chat_template
    assert card.capabilities == ("text", "tools", "thinking")
    assert card.tool_call_format == "hermes"


def test_a_hub_card_matches_the_local_one_and_reads_no_weights(
    hub_env: HubServer, checkouts: dict[str, Path]
) -> None:
    before = len(hub_env.requests)
    card = card_for_hub_repository(REPO, "main", SUPPORTED, trust_remote_code=False)
    local = card_from_local_directory(checkouts[REPO])
    assert card.model_id == REPO
    repository = hub_env.repositories[REPO]
    assert card.source == HuggingFaceSource(repo_id=REPO, revision=repository.sha)
    for field in ("n_layers", "hidden_size", "num_key_value_heads", "vocab_size",
                  "parameter_count", "storage_size_bytes", "context_length",
                  "tie_word_embeddings", "has_chat_template"):  # fmt: skip
        assert getattr(card, field) == getattr(local, field), field
    assert card.capabilities == ("text", "tools", "thinking")
    assert not card.gated
    asked = hub_env.requests[before:]
    weights = [r for r in asked if r.filename == "model.safetensors" and r.method == "GET"]
    # One ranged read of the header; the weights themselves are never fetched.
    assert [r.range for r in weights] == ["bytes=0-100000"]
    fetched = {r.filename for r in asked if r.method == "GET" and r.filename}
    assert fetched == {
        "config.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "model.safetensors",
    }


def test_a_sharded_checkpoint_counts_every_file_of_its_index(
    hub_env: HubServer, checkouts: dict[str, Path]
) -> None:
    card = card_for_hub_repository(SHARDED_REPO, "main", SUPPORTED, trust_remote_code=False)
    local = card_from_local_directory(checkouts[SHARDED_REPO])
    assert card.parameter_count == local.parameter_count
    assert card.storage_size_bytes == local.storage_size_bytes
    assert card.n_layers == 3
    # Qwen3 has no q/k/v biases; no chat template: a base model.
    assert not card.attention_bias
    assert not card.has_chat_template
    assert card.capabilities == ("text",)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert hub_env.file_requests(SHARDED_REPO, name) == 1


def test_custom_code_is_refused_without_the_flag(
    hub_env: HubServer, checkouts: dict[str, Path]
) -> None:
    for call, model in (
        (card_for_hub_repository, CUSTOM_CODE_REPO),
        (card_for_local_directory, str(checkouts[CUSTOM_CODE_REPO])),
    ):
        args = (model, "main") if call is card_for_hub_repository else (model,)
        error = refusal(call, *args, SUPPORTED, False)
        assert error.status_code == 400
        assert "trust_remote_code" in error.message
        assert "--trust-remote-code" in error.message
        assert "auto_map" in error.message
    # With the flag, the architecture (Llama here) still decides.
    card = card_for_hub_repository(CUSTOM_CODE_REPO, "main", SUPPORTED, trust_remote_code=True)
    assert card.architecture == "LlamaForCausalLM"


def test_kimi_k2s_custom_code_is_read_without_it(
    hub_env: HubServer, checkouts: dict[str, Path], tmp_path: Path
) -> None:
    """Kimi-K2's config (`kimi_k2`) and TikToken tokenizer (`tokenization_kimi`) name code
    in `auto_map` that exo reads without (`MODEL_TYPE_ALIASES`, `tokenizer_loading`): no
    flag is needed, on the Hub or on disk. Another tokenizer code still needs it."""
    directory = checkouts[KIMI_REPO]
    for card in (
        card_for_hub_repository(KIMI_REPO, "main", SUPPORTED, trust_remote_code=False),
        card_for_local_directory(str(directory), SUPPORTED, trust_remote_code=False),
    ):
        assert card.architecture == "DeepseekV3ForCausalLM"
        assert card.tool_call_format == "kimi_k2" and "tools" in card.capabilities
        assert card.latent_attention is not None
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_other.Tokenizer", None]}
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    error = refusal(card_for_local_directory, str(other), SUPPORTED, False)
    assert error.status_code == 400
    assert "tokenizer_config.json name custom code" in error.message


def test_an_architecture_without_a_family_file_is_named(hub_env: HubServer) -> None:
    for trust in (False, True):
        error = refusal(card_for_hub_repository, FOREIGN_REPO, "main", SUPPORTED, trust)
        assert error.status_code == 400
        assert "FalconForCausalLM" in error.message
        assert "LlamaForCausalLM" in error.message  # the supported ones are listed


def test_a_gated_model_needs_a_token_with_access(
    hub_env: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    error = refusal(card_for_hub_repository, GATED_REPO, "main", SUPPORTED, False)
    assert error.status_code == 401
    assert "set HF_TOKEN" in error.message
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    error = refusal(card_for_hub_repository, GATED_REPO, "main", SUPPORTED, False)
    assert error.status_code == 403
    assert "no access" in error.message
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    card = card_for_hub_repository(GATED_REPO, "main", SUPPORTED, False)
    assert card.gated
    assert any(r.authorization == f"Bearer {TOKEN}" for r in hub_env.requests)


def test_unknown_repositories_and_revisions_are_404(hub_env: HubServer) -> None:
    error = refusal(card_for_hub_repository, "nobody/nothing", "main", SUPPORTED, False)
    assert error.status_code == 404
    assert "nobody/nothing" in error.message
    error = refusal(card_for_hub_repository, REPO, "v9", SUPPORTED, False)
    assert error.status_code == 404
    assert "v9" in error.message


def test_a_missing_directory_is_404_and_an_incomplete_one_400(tmp_path: Path) -> None:
    error = refusal(card_for_local_directory, str(tmp_path / "absent"), SUPPORTED, False)
    assert error.status_code == 404
    error = refusal(card_for_local_directory, str(tmp_path), SUPPORTED, False)
    assert error.status_code == 400
    assert "config.json" in error.message


def test_a_hub_that_does_not_answer_is_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    error = refusal(card_for_hub_repository, REPO, "main", SUPPORTED, False)
    assert error.status_code == 503
    assert "127.0.0.1" in error.message


def test_search_reports_each_models_architecture(hub_env: HubServer) -> None:
    results = {result.model_id: result for result in search_hub("tiny", 10)}
    assert set(results) == {
        REPO, SHARDED_REPO, GATED_REPO, CUSTOM_CODE_REPO, FOREIGN_REPO, KIMI_REPO,
    }  # fmt: skip
    assert results[KIMI_REPO].architecture == "DeepseekV3ForCausalLM"
    assert results[FOREIGN_REPO].architecture == "FalconForCausalLM"
    assert results[SHARDED_REPO].architecture == "Qwen3ForCausalLM"
    assert results[GATED_REPO].gated
    assert len(search_hub("tiny", 2)) == 2
    assert search_hub("no-such-model", 5) == []


@pytest.mark.parametrize(
    ("template", "capabilities", "tool_call_format"),
    [
        ("{{ messages }}", ("text",), "none"),
        ("[TOOL_CALLS]", ("text", "tools"), "mistral"),
        ("<|python_tag|>", ("text", "tools"), "llama3_json"),
        ("<think>", ("text", "thinking"), "none"),
        ("<|start|>assistant<|channel|>analysis", ("text", "tools", "thinking"), "harmony"),
        ("{{ tools }}<tool_call><function=x>", ("text", "tools"), "qwen3_coder"),
        (
            "{{ tools }}<tool_call>x<arg_key>k</arg_key><think>",
            ("text", "tools", "thinking"),
            "glm45",
        ),
        ("{{ tools }}<minimax:tool_call><think>", ("text", "tools", "thinking"), "minimax_m2"),
        ("{{ tools }}<|tool_calls_section_begin|>", ("text", "tools"), "kimi_k2"),
        ("{{ tools }}<｜tool▁calls▁begin｜><think>", ("text", "tools", "thinking"), "deepseek_v3"),
        # DeepSeek-R1's template writes its markup in history but takes no tools.
        ("<｜tool▁calls▁begin｜><think>", ("text", "thinking"), "none"),
    ],
)
def test_template_traits(
    template: str, capabilities: tuple[str, ...], tool_call_format: str
) -> None:
    assert template_traits(template) == (capabilities, tool_call_format)
