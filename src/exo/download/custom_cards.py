"""Cards for models outside the catalog (`POST /models/add`), built from a repository's
small files: `config.json`, the safetensors headers (read with `Range` requests, never the
weights), the tokenizer's chat template and `generation_config.json`.

A model is a Hugging Face Hub repository (`org/name`, through `huggingface_hub`, honouring
`HF_ENDPOINT` and `HF_TOKEN` as they are when asked) or a local HF-format directory (a path
starting with `/`, `~` or `.`). Every refusal is a `CustomModelError` with the HTTP status
the API answers: 404 unknown repository, 401 / 403 gated without access, 400 custom code
without `--trust-remote-code`, an architecture no family file covers, or files the engine
cannot load; 503 when the Hub cannot be reached.

Searching the Hub is `exo.download.hub_search`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from exo.chat_protocol.format_detection import template_tool_call_format
from exo.chat_protocol.image_tokens import ImageTokens
from exo.chat_protocol.tokenizer_loading import names_kimi_tokenizer
from exo.download.locations import ModelLocations, candidates
from exo.shared.models.architectures import MODEL_TYPE_ALIASES, is_encoder_architecture
from exo.shared.models.cards import (
    TOKENIZER_FILES,
    SafetensorsHeader,
    card_from_config,
    card_from_local_directory,
    chat_template_in_tokenizer_config,
)
from exo.shared.types.common import ModelId
from exo.shared.types.models import (
    Capability,
    CardToolCallFormat,
    HuggingFaceSource,
    ModelCard,
    SamplingDefaults,
)

DEFAULT_ENDPOINT = "https://huggingface.co"
CONFIG_FILE = "config.json"
# How many of a directory's GGUF files a refusal to add the directory names.
GGUF_NAMES_SHOWN = 3
INDEX_FILE = "model.safetensors.index.json"
SMALL_FILES = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")
# Repository ids as the Hub spells them: `org/name`, letters, digits, `-`, `_`, `.`.
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
HUB_TIMEOUT_SECONDS = 30.0


class CustomModelError(ValueError):
    """A model that cannot be added, and the HTTP status the API answers with."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code


def hub_endpoint() -> str:
    """The Hub to ask: `HF_ENDPOINT` as set now (a mirror, or a test server)."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def is_local_path(model_id: str) -> bool:
    return model_id.startswith(("/", "~", "."))


@dataclass(frozen=True, slots=True)
class RepositoryFiles:
    """The small files of a checkpoint a card is built from (None: the file is absent)."""

    config: Mapping[str, Any]
    safetensors_headers: tuple[tuple[str, SafetensorsHeader], ...]
    tokenizer_config: Mapping[str, Any] | None = None
    chat_template: str | None = None
    generation_config: Mapping[str, Any] | None = None


def refuse_unsupported(
    files: RepositoryFiles, origin: str, supported: Collection[str], trust_remote_code: bool
) -> None:
    """Refuse a checkpoint the engine must not or cannot run.

    Args:
        supported: the `architectures` names the engine has family files for.
        trust_remote_code: whether the node was started with `--trust-remote-code`.

    Raises:
        CustomModelError (400): its config or tokenizer asks for custom code (`auto_map`)
            other than Kimi-K2's, which exo reads without it, and the flag is off; or its
            architecture has no family file (named, with the supported ones).
    """
    architectures = files.config.get("architectures")
    architecture = (
        str(architectures[0]) if isinstance(architectures, list) and architectures else None
    )
    # Kimi-K2's model type and TikToken tokenizer name custom code that exo reads
    # without it (`MODEL_TYPE_ALIASES`, `tokenizer_loading`); an encoder's config too
    # (nomic-embed-text's NomicBERT): the engine's own encoder forward computes it.
    read_without_code = {
        "config.json": files.config.get("model_type") in MODEL_TYPE_ALIASES
        or (architecture is not None and is_encoder_architecture(architecture)),
        "tokenizer_config.json": names_kimi_tokenizer(files.tokenizer_config),
    }
    custom_code = [
        name
        for name, content in (
            ("config.json", files.config),
            ("tokenizer_config.json", files.tokenizer_config),
        )
        if isinstance(content, Mapping) and content.get("auto_map") and not read_without_code[name]
    ]
    if custom_code and not trust_remote_code:
        raise CustomModelError(
            f"{origin} needs trust_remote_code: its {' and '.join(custom_code)} name custom "
            "code (auto_map). exo runs no code from a repository; start the node with "
            "--trust-remote-code to add it anyway (the engine still runs it only with one "
            "of its own model family files, never the repository's code)",
            400,
        )
    if architecture is None:
        raise CustomModelError(f"{origin}'s config.json has no architectures field", 400)
    if architecture not in supported:
        raise CustomModelError(
            f"{origin} is a {architecture} model, an architecture with no model family file "
            f"in this engine; supported: {', '.join(supported)}",
            400,
        )


def template_traits(
    template: str,
) -> tuple[tuple[Capability, ...], CardToolCallFormat]:
    """Capabilities and tool-call format a chat template shows: `<think>` (or gpt-oss's
    analysis channel) for thinking; the tool markup `template_tool_call_format` reads, or
    Llama 3's ipython role, for tools. A template with none of them gets text only and the
    generic format's fallback parsing."""
    capabilities: list[Capability] = ["text"]
    tool_call_format: CardToolCallFormat = template_tool_call_format(template) or "none"
    if tool_call_format == "none" and "ipython" in template:
        tool_call_format = "llama3_json"
    if tool_call_format != "none":
        capabilities.append("tools")
    if "<think>" in template or tool_call_format == "harmony":
        capabilities.append("thinking")
    return tuple(capabilities), tool_call_format


def _sampling_defaults(generation_config: Mapping[str, Any] | None) -> SamplingDefaults:
    """The model's own sampling defaults (`generation_config.json`), where it has them."""
    defaults = SamplingDefaults()
    if not generation_config or generation_config.get("do_sample") is False:
        return defaults
    update: dict[str, Any] = {}
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
        value = generation_config.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            update[name] = kind(value)
    return SamplingDefaults.model_validate({**defaults.model_dump(), **update})


def card_from_repository_files(
    model_id: ModelId,
    source: HuggingFaceSource,
    files: RepositoryFiles,
    gated: bool,
) -> ModelCard:
    """A card from a Hub repository's small files (see `card_from_config`), with the
    capabilities and tool-call format its chat template shows and its sampling defaults.

    Raises:
        CustomModelError (400): a required config field is missing or a header is invalid.
    """
    template = files.chat_template
    if template is None and files.tokenizer_config is not None:
        stored = files.tokenizer_config.get("chat_template")
        template = json.dumps(stored) if stored else None
    chat_template = template is not None or chat_template_in_tokenizer_config(
        files.tokenizer_config
    )
    try:
        card = card_from_config(
            model_id, source, files.config, files.safetensors_headers, chat_template, model_id
        )
    except (ValueError, KeyError, TypeError) as error:
        raise CustomModelError(f"cannot build a card for {model_id}: {error}", 400) from None
    return with_traits(card, template, files.generation_config, gated, files.config)


def with_traits(
    card: ModelCard,
    template: str | None,
    generation_config: Mapping[str, Any] | None,
    gated: bool,
    config: Mapping[str, Any] | None = None,
) -> ModelCard:
    """`card` with what the template, generation config, the Hub's gate and `config`
    (`config.json`) say. `vision` is added for a checkpoint whose config an image-token
    family serves (`ImageTokens.serves`, as the engine decides to load a tower) and whose
    files hold its tower's weights (`card.vision_parameter_count`); a text-only copy of a
    vision model has none and stays text-only."""
    capabilities, tool_call_format = template_traits(template or "")
    if config is not None and ImageTokens.serves(config) and card.vision_parameter_count:
        capabilities = (*capabilities, "vision")
    update: dict[str, Any] = {
        "capabilities": capabilities,
        "tool_call_format": tool_call_format,
        "sampling_defaults": _sampling_defaults(generation_config),
        "gated": gated,
    }
    if is_encoder_architecture(card.architecture):
        update |= _encoder_traits(card.architecture, config or {})
    try:
        # model_copy does not validate; a JSON round trip does.
        return ModelCard.model_validate_json(card.model_copy(update=update).model_dump_json())
    except ValidationError as error:
        raise CustomModelError(f"cannot build a card for {card.model_id}: {error}", 400) from None


def _encoder_traits(architecture: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """What an encoder card (`ENCODER_ARCHITECTURES`) says, as the catalog's encoder cards
    say it: "rerank" for a cross-encoder (`*ForSequenceClassification`, one score per
    pair), "embedding" otherwise, never "text" (no chat, no template, one node); its
    context the tokens one input may have, as the encoder engine reads them from `config`
    (NomicBERT's `max_trained_positions`; (XLM-)RoBERTa's positions start after the
    padding index, so `max_position_embeddings - pad_token_id - 1`: 8194 -> 8192 for
    bge-m3)."""
    rerank = architecture.endswith("ForSequenceClassification")
    update: dict[str, Any] = {
        "capabilities": ("rerank",) if rerank else ("embedding",),
        "tool_call_format": "none",
        "has_chat_template": False,
        "supports_tensor": False,
    }
    model_type = str(config.get("model_type", ""))
    positions = config.get("max_trained_positions") or config.get("max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool):
        if "roberta" in model_type:
            pad = config.get("pad_token_id")
            positions -= (pad if isinstance(pad, int) else 1) + 1
        if positions > 0:
            update["context_length"] = positions
    return update


def _gguf_hint(directory: Path) -> str:
    """What to add instead when `directory` holds GGUF files (the first few named): each is
    added by its own path (a model in several parts by its first part's); "" when none. The
    example is the largest file (the first by name among equals): an empty or partial file
    that sorts first would make a bad one."""
    files = sorted(child for child in directory.glob("*.gguf") if child.is_file())
    names = [file.name for file in files]
    if not names:
        return ""
    example = max(files, key=lambda file: file.stat().st_size)  # the first of the largest
    shown = ", ".join(names[:GGUF_NAMES_SHOWN])
    more = f" and {len(names) - GGUF_NAMES_SHOWN} more" if len(names) > GGUF_NAMES_SHOWN else ""
    return (
        f"; it holds GGUF files ({shown}{more}): add one GGUF file by its path, e.g. "
        f"{example} (for a model in several parts, its first part)"
    )


def card_for_local_directory(
    path: str, supported: Collection[str], trust_remote_code: bool
) -> ModelCard:
    """The card of a local HF-format directory (its id is the absolute path).

    Raises:
        CustomModelError: 404 when it does not exist; 400 for what `refuse_unsupported`
            refuses or a directory the engine cannot load.
    """
    directory = Path(path).expanduser().resolve()
    if not directory.is_dir():
        raise CustomModelError(f"no model directory {directory} on this node", 404)
    try:
        config = _read_json(directory / CONFIG_FILE)
        if config is None:
            raise CustomModelError(f"{directory} has no config.json{_gguf_hint(directory)}", 400)
        files = RepositoryFiles(
            config=config,
            safetensors_headers=(),
            tokenizer_config=_read_json(directory / "tokenizer_config.json"),
            chat_template=_read_text(directory / "chat_template.jinja"),
            generation_config=_read_json(directory / "generation_config.json"),
        )
        refuse_unsupported(files, str(directory), supported, trust_remote_code)
        card = card_from_local_directory(directory)
    except CustomModelError:
        raise
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise CustomModelError(f"cannot add {directory}: {error}", 400) from None
    template = files.chat_template
    if template is None and files.tokenizer_config is not None:
        stored = files.tokenizer_config.get("chat_template")
        template = json.dumps(stored) if stored else None
    return with_traits(card, template, files.generation_config, gated=False, config=config)


def card_for_cached_repository(
    repo_id: str,
    revision: str,
    locations: ModelLocations,
    supported: Collection[str],
    trust_remote_code: bool,
) -> ModelCard | None:
    """The card of Hub repository `repo_id` built from a copy already on this machine, for
    an `--offline` node: the first of `locations.candidates` (a models directory's
    `<org>--<name>` or `<org>/<name>`, then the Hugging Face cache's snapshot of `revision`)
    holding its config.json, safetensors weights and tokenizer. The card names the
    repository (its source pinned to the snapshot's commit where the copy is one), so the
    download step finds the same copy and uses it in place. None when no copy is whole.

    Raises:
        CustomModelError: 400 for a copy whose model `refuse_unsupported` refuses.
    """
    directory = whole_local_copy(repo_id, revision, locations)
    if directory is None:
        return None
    local = card_for_local_directory(str(directory), supported, trust_remote_code)
    snapshot = directory.parent.name == "snapshots"
    commit = directory.name if snapshot else revision
    card = local.model_copy(
        update={
            "model_id": ModelId(repo_id),
            "source": HuggingFaceSource(repo_id=repo_id, revision=commit),
        }
    )
    return ModelCard.model_validate_json(card.model_dump_json())


def whole_local_copy(repo_id: str, revision: str, locations: ModelLocations) -> Path | None:
    """The first of `locations.candidates` for Hub repository `repo_id` at `revision` that
    holds a whole copy (config.json, safetensors weights and a tokenizer), or None: what
    an `--offline` node builds the card from (`card_for_cached_repository`), and what an
    online node that cannot reach the Hub points to."""
    for directory in candidates(locations, repo_id, repo_id, revision):
        whole = (
            (directory / CONFIG_FILE).is_file()
            and any(directory.glob("*.safetensors"))
            and any((directory / name).is_file() for name in TOKENIZER_FILES)
        )
        if whole:
            return directory
    return None  # not anywhere, or only incomplete copies


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    content = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(content, dict):
        raise ValueError(f"{path} is not a JSON object")
    return content


def _read_text(path: Path) -> str | None:
    return path.read_text(encoding="utf-8") if path.is_file() else None


def card_for_hub_repository(
    repo_id: str,
    revision: str,
    supported: Collection[str],
    trust_remote_code: bool,
) -> ModelCard:
    """The card of a Hub repository, pinned to the commit `revision` resolves to.

    Reads the model info, then `config.json`, the tokenizer's small files and
    `generation_config.json` (downloaded into a temporary directory and dropped), and the
    header of every safetensors file (one `Range` request each). Blocking: call it from
    a worker thread.

    Raises:
        CustomModelError: see the module docstring.
    """
    from huggingface_hub import HfApi, get_token, hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = hub_endpoint()
    api = HfApi(endpoint=endpoint)
    try:
        info = api.model_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_SECONDS)
        names = {sibling.rfilename for sibling in info.siblings or ()}
        commit = info.sha or revision
        _refuse_unloadable(repo_id, names)
        with tempfile.TemporaryDirectory(prefix="exo-card-") as scratch:

            def small_file(name: str) -> Path | None:
                if name not in names:
                    return None
                downloaded = hf_hub_download(
                    repo_id, name, revision=commit, endpoint=endpoint, local_dir=scratch
                )
                return Path(str(downloaded))

            config_path = small_file(CONFIG_FILE)
            assert config_path is not None  # _refuse_unloadable checked it is there
            config = _read_json(config_path) or {}
            tokenizer_config = _optional_json(small_file("tokenizer_config.json"))
            template_path = small_file("chat_template.jinja")
            generation_config = _optional_json(small_file("generation_config.json"))
            files = RepositoryFiles(
                config=config,
                safetensors_headers=(),
                tokenizer_config=tokenizer_config,
                chat_template=_read_text(template_path) if template_path else None,
                generation_config=generation_config,
            )
            refuse_unsupported(files, repo_id, supported, trust_remote_code)
            index_path = small_file(INDEX_FILE)
            weight_files = _weight_files(names, index_path)
        headers = tuple(
            (name, _header_of(api, repo_id, name, commit)) for name in sorted(weight_files)
        )
    except CustomModelError:
        raise
    except GatedRepoError as error:
        status = _status_of(error, default=401)
        if get_token() is None:
            message = (
                f"{repo_id} is a gated model: set HF_TOKEN (on every node) to a token of an "
                f"account that accepted its terms at {endpoint}/{repo_id}"
            )
        else:
            message = (
                f"{repo_id} is a gated model and the token in HF_TOKEN has no access to it: "
                f"accept its terms at {endpoint}/{repo_id} with that account"
            )
        raise CustomModelError(message, 403 if status == 403 else 401) from None
    except RevisionNotFoundError:
        raise CustomModelError(f"{repo_id} has no revision {revision!r}", 404) from None
    except RepositoryNotFoundError:
        raise CustomModelError(
            f"no model repository {repo_id!r} on {endpoint} (a private one needs HF_TOKEN)",
            404,
        ) from None
    except HfHubHTTPError as error:
        raise CustomModelError(f"the Hub at {endpoint} refused: {error}", 503) from None
    except OSError as error:
        raise CustomModelError(f"cannot read {repo_id} from {endpoint}: {error}", 503) from None
    except ValueError as error:  # a small file that is not what it should be
        raise CustomModelError(f"cannot build a card for {repo_id}: {error}", 400) from None
    except Exception as error:
        if is_network_error(error):
            raise CustomModelError(
                f"cannot reach the Hugging Face Hub at {endpoint}: {error}", 503
            ) from None
        raise
    source = HuggingFaceSource(repo_id=repo_id, revision=commit)
    gated = bool(getattr(info, "gated", False))
    return card_from_repository_files(
        ModelId(repo_id),
        source,
        RepositoryFiles(
            config=files.config,
            safetensors_headers=headers,
            tokenizer_config=files.tokenizer_config,
            chat_template=files.chat_template,
            generation_config=files.generation_config,
        ),
        gated,
    )


def _refuse_unloadable(repo_id: str, names: set[str]) -> None:
    """The engine loads config.json + safetensors + a tokenizer; refuse anything else."""
    if CONFIG_FILE not in names:
        raise CustomModelError(f"{repo_id} has no config.json", 400)
    if INDEX_FILE not in names and not any(
        "/" not in name and name.endswith(".safetensors") for name in names
    ):
        raise CustomModelError(
            f"{repo_id} has no safetensors weights (exo loads *.safetensors only; "
            f"files: {', '.join(sorted(names)[:20])})",
            400,
        )
    if not names.intersection(TOKENIZER_FILES):
        raise CustomModelError(f"{repo_id} has no tokenizer ({' or '.join(TOKENIZER_FILES)})", 400)


def _weight_files(names: set[str], index_path: Path | None) -> set[str]:
    """The safetensors files holding the weights: the index's, else the top-level ones."""
    if index_path is None:
        return {name for name in names if "/" not in name and name.endswith(".safetensors")}
    weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CustomModelError(f"{INDEX_FILE} has no weight_map", 400)
    return {str(name) for name in weight_map.values()}


def _header_of(api: Any, repo_id: str, name: str, commit: str) -> dict[str, Any]:
    """One safetensors file's header, read with a `Range` request (no tensor data)."""
    metadata = api.parse_safetensors_file_metadata(
        repo_id, name, revision=commit, timeout=HUB_TIMEOUT_SECONDS
    )
    return {
        tensor_name: {"dtype": tensor.dtype, "shape": list(tensor.shape)}
        for tensor_name, tensor in metadata.tensors.items()
    }


def _optional_json(path: Path | None) -> dict[str, Any] | None:
    return _read_json(path) if path is not None else None


def _status_of(error: Exception, default: int) -> int:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else default


def is_network_error(error: Exception) -> bool:
    """A transport failure of huggingface_hub's HTTP client (no answer from the Hub)."""
    return any(
        cls.__name__ in ("TransportError", "ConnectError", "TimeoutException", "NetworkError")
        for cls in type(error).__mro__
    )
