"""Model cards: the built-in TOML cards and cards built from a local HF-format directory."""

from __future__ import annotations

import difflib
import json
import struct
import tomllib
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from exo.shared.models.latent_attention import latent_attention_of_config
from exo.shared.models.moe import moe_geometry_of_config
from exo.shared.models.names import card_names, resolve_model_name
from exo.shared.types.common import ModelId
from exo.shared.types.models import LocalDirectorySource, ModelCard, ModelSource, SlidingWindow

CARDS_PACKAGE = "exo.resources"
CARDS_SUBDIRECTORY = "model_cards"
# A TikToken `tiktoken.model` is Kimi's (`exo.chat_protocol.tokenizer_loading`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model")
# Bytes per element of each safetensors dtype (safetensors format spec).
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
VISION_TENSOR_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "vision_model.", "connector.", "visual.",
)  # fmt: skip
"""Where a multimodal checkpoint keeps its vision tower and projector (names with a leading
`model.` removed): Gemma 3 and Mistral 3 under `vision_tower.` and `multi_modal_projector.`,
Idefics3 / SmolVLM under `vision_model.` and `connector.`, Qwen2.5-VL and Qwen3-VL under
`visual.`; the engine's towers read the same names (each family's `checkpoint_prefixes`)."""
# A safetensors header longer than this is corrupt, not a model (the format caps it at 100 MB).
_MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
CLOSEST_NAMES = 3
"""How many known names an unknown model's error suggests."""


class UnknownModelError(ValueError):
    """A model id that is neither a built-in card nor an existing local model directory."""


def _card_from_toml(data: dict[str, Any], origin: str) -> ModelCard:
    # TOML arrays arrive as lists; the JSON path of the strict model accepts them as tuples.
    try:
        return ModelCard.model_validate_json(json.dumps(data))
    except ValidationError as error:
        raise ValueError(f"invalid model card {origin}: {error}") from error


def load_builtin_cards() -> dict[ModelId, ModelCard]:
    """Read every `*.toml` card shipped in `exo/resources/model_cards/`.

    Returns:
        The cards keyed by model id.

    Raises:
        ValueError: a card is malformed or two cards share an id.
    """
    cards: dict[ModelId, ModelCard] = {}
    directory = resources.files(CARDS_PACKAGE).joinpath(CARDS_SUBDIRECTORY)
    for entry in sorted(directory.iterdir(), key=lambda item: item.name):
        if not entry.name.endswith(".toml"):
            continue
        try:
            data = tomllib.loads(entry.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"invalid model card {entry.name}: {error}") from error
        card = _card_from_toml(data, entry.name)
        if card.model_id in cards:
            raise ValueError(f"duplicate model card id {card.model_id} in {entry.name}")
        cards[card.model_id] = card
    return cards


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Read the JSON header of a safetensors file without touching the tensor data.

    The format is: 8-byte little-endian header length, then that many bytes of JSON mapping
    tensor names to `{"dtype", "shape", "data_offsets"}` (plus an optional `__metadata__`).
    """
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > _MAX_SAFETENSORS_HEADER_BYTES:
            raise ValueError(f"{path} is not a safetensors file (header of {header_length} B)")
        header: dict[str, Any] = json.loads(handle.read(header_length))
    return header


SafetensorsHeader = Mapping[str, Any]
"""A safetensors file's header: tensor name -> `{"dtype", "shape", ...}` (plus an optional
`__metadata__`)."""


def _weight_elements(name: str, count: int) -> int:
    """The weights a stored tensor of `count` elements holds: a weight repacked from GGUF
    (`exo.download.gguf_repack`) holds two per packed byte, none in its scales and zeros,
    and a GGML block's values per block of raw bytes; an FP8 block checkpoint's
    `*_scale_inv` (one float per block of its weight) holds none."""
    if name.endswith(".int4_packed"):
        return 2 * count
    if name.endswith((".int4_scales", ".int4_zeros", ".int4_q4k_scales", "_scale_inv")):
        return 0
    _, marker, type_name = name.rpartition(".gguf_")
    if marker:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        return count // type_size * block_size
    return count


def _weight_totals(headers: Sequence[tuple[str, SafetensorsHeader]]) -> tuple[int, int]:
    """(number of weights, bytes they take on disk) over all files (`(file name, header)`
    pairs); a tensor name seen twice counts once."""
    seen: set[str] = set()
    elements = 0
    stored_bytes = 0
    for file_name, header in headers:
        for name, entry in header.items():
            if name == "__metadata__" or name in seen:
                continue
            if entry["dtype"] not in SAFETENSORS_DTYPE_BYTES:
                raise ValueError(f"{file_name}: tensor {name} has unknown dtype {entry['dtype']}")
            seen.add(name)
            count = 1
            for dimension in entry["shape"]:
                count *= int(dimension)
            elements += _weight_elements(name, count)
            stored_bytes += count * SAFETENSORS_DTYPE_BYTES[entry["dtype"]]
    return elements, stored_bytes


def _vision_weights(headers: Sequence[tuple[str, SafetensorsHeader]]) -> int:
    """The number of weights under `VISION_TENSOR_PREFIXES` over all files (a tensor name
    seen twice counts once)."""
    seen: set[str] = set()
    elements = 0
    for _, header in headers:
        for name, entry in header.items():
            if name in seen or not name.removeprefix("model.").startswith(VISION_TENSOR_PREFIXES):
                continue
            seen.add(name)
            count = 1
            for dimension in entry["shape"]:
                count *= int(dimension)
            elements += _weight_elements(name, count)
    return elements


def _stores_attention_bias(headers: Sequence[tuple[str, SafetensorsHeader]]) -> bool:
    """Whether the checkpoint has biases on its query projections."""
    return any(
        name.endswith(("q_proj.bias", "qkv_proj.bias")) for _, header in headers for name in header
    )


def _required(config: Mapping[str, Any], origin: str, *names: str) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"{origin} has no {' / '.join(names)} field")


def chat_template_in_tokenizer_config(tokenizer_config: Mapping[str, Any] | None) -> bool:
    """Whether `tokenizer_config.json`'s content holds a chat template (a string, or a list
    of named templates)."""
    return isinstance(tokenizer_config, Mapping) and bool(tokenizer_config.get("chat_template"))


def has_chat_template(directory: Path) -> bool:
    """Whether an HF-format directory's tokenizer has a chat template: transformers keeps it
    in `chat_template.jinja`, `chat_template.json`, or `tokenizer_config.json`'s
    `chat_template` (a string, or a list of named templates). A base model has none."""
    if (directory / "chat_template.jinja").is_file() or (
        directory / "chat_template.json"
    ).is_file():
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return chat_template_in_tokenizer_config(config)


def card_from_config(
    model_id: ModelId,
    source: ModelSource,
    config: Mapping[str, Any],
    safetensors_headers: Sequence[tuple[str, SafetensorsHeader]],
    chat_template: bool,
    origin: str,
) -> ModelCard:
    """Build a card from a checkpoint's `config.json` and its safetensors headers.

    `parameter_count` is the number of weights in the safetensors files (a tied LM head is
    stored once, so counted once); `storage_size_bytes` the bytes they take in the files'
    dtypes; `vision_parameter_count`, for a config with a `vision_config`, the weights of
    its vision tower and projector (`VISION_TENSOR_PREFIXES`). The capabilities are left
    at text only: what the chat template and config show is `custom_cards.with_traits`'s.

    Args:
        safetensors_headers: `(file name, header)` of every weights file.
        chat_template: whether the tokenizer has a chat template (False: a base model).
        origin: where the config came from, for error messages (a path or a repository).

    Raises:
        ValueError: no weights, or a required config field (architectures, layer count,
            sizes) is missing.
    """
    if not safetensors_headers:
        raise ValueError(f"{origin} has no *.safetensors weights")
    # Multimodal configs nest the language model's fields under text_config.
    text_config: dict[str, Any] = {**config, **config.get("text_config", {})}
    architectures = config.get("architectures")
    if not architectures or not isinstance(architectures, list):
        raise ValueError(f"{origin}'s config.json has no architectures field")
    where = f"{origin}'s config.json"
    n_layers = _required(text_config, where, "num_hidden_layers", "n_layer")
    hidden_size = _required(text_config, where, "hidden_size", "n_embd")
    num_attention_heads = _required(text_config, where, "num_attention_heads", "n_head")
    num_key_value_heads = text_config.get("num_key_value_heads") or num_attention_heads
    intermediate_size = text_config.get("intermediate_size") or 4 * hidden_size
    vocab_size = _required(text_config, where, "vocab_size")
    context_length = _required(
        text_config, where, "max_position_embeddings", "n_positions", "max_seq_len"
    )
    head_dim = text_config.get("head_dim")
    try:
        moe = moe_geometry_of_config(text_config)
        latent_attention = latent_attention_of_config(text_config)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error
    parameter_count, stored_bytes = _weight_totals(safetensors_headers)
    sliding_window = sliding_window_of_config(text_config)
    return ModelCard(
        model_id=model_id,
        source=source,
        architecture=str(architectures[0]),
        n_layers=n_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=int(num_key_value_heads),
        intermediate_size=int(intermediate_size),
        vocab_size=vocab_size,
        storage_size_bytes=stored_bytes,
        context_length=context_length,
        head_dim=head_dim if isinstance(head_dim, int) and head_dim > 0 else None,
        # transformers' PretrainedConfig ties the embeddings unless the config says not to.
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        # Qwen2 always has q/k/v biases without an `attention_bias` field: read the weights.
        attention_bias=bool(text_config.get("attention_bias", False))
        or _stores_attention_bias(safetensors_headers),
        parameter_count=parameter_count,
        vision_parameter_count=(
            _vision_weights(safetensors_headers) if config.get("vision_config") else 0
        ),
        has_chat_template=chat_template,
        # Tensor parallel splits heads, KV heads and the MLP (every expert's) evenly over
        # 2 ranks at least.
        supports_tensor=(
            num_attention_heads % 2 == 0
            and int(num_key_value_heads) % 2 == 0
            and int(intermediate_size) % 2 == 0
            and (moe is None or moe.expert_intermediate_size % 2 == 0)
        ),
        moe=moe,
        latent_attention=latent_attention,
        sliding_window=sliding_window,
    )


def sliding_window_of_config(config: Mapping[str, Any]) -> SlidingWindow | None:
    """The sliding-window layers a (text) config lists in `layer_types`
    ("sliding_attention" layers with an integer `sliding_window`: Gemma 3, gpt-oss), None
    when it lists none. A config without `layer_types` gives None even where its family
    slides every layer (Mistral 7B v0.1): placement then sizes those layers whole, which
    only over-reserves."""
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if not isinstance(layer_types, list):
        return None
    layers = sum(1 for kind in layer_types if kind == "sliding_attention")
    return SlidingWindow(window=window, layers=layers) if layers else None


def card_from_local_directory(path: Path) -> ModelCard:
    """Build a card for an HF-format directory from its config.json and safetensors headers
    (no tensor is loaded; see `card_from_config`).

    Args:
        path: the model directory.

    Returns:
        A card whose model id is the absolute path and whose source is that directory.

    Raises:
        ValueError: the directory, config.json, safetensors weights, tokenizer or a required
            config field (architectures, layer count, sizes) is missing.
    """
    directory = path.expanduser().resolve()
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory} has no config.json")
    safetensors_files = sorted(directory.glob("*.safetensors"))
    if not safetensors_files:
        raise ValueError(f"{directory} has no *.safetensors weights")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{directory} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    return card_from_config(
        ModelId(str(directory)),
        LocalDirectorySource(path=str(directory)),
        config,
        [(path.name, read_safetensors_header(path)) for path in safetensors_files],
        has_chat_template(directory),
        str(directory),
    )


def with_custom_cards(
    builtin: Mapping[ModelId, ModelCard], custom: Mapping[ModelId, ModelCard]
) -> dict[ModelId, ModelCard]:
    """Every card the cluster knows: the catalog's first, then the custom models of the
    state (`State.custom_cards`). A catalog id always means the catalog's card.

    The API's `ClusterClient.cards` is this merge, so a custom model is listed and its
    card found like a catalog model's everywhere; names resolve through
    `resolve_model_name(..., custom_cards=...)` (and `resolve_card`), where a catalog
    card's names win over a custom card's."""
    return {**builtin, **{k: v for k, v in custom.items() if k not in builtin}}


def resolve_card(
    model_id: str,
    builtin: Mapping[ModelId, ModelCard],
    custom: Mapping[ModelId, ModelCard] | None = None,
) -> ModelCard:
    """The card for a requested model: a built-in card by any of its names (id, short name,
    see `exo.shared.models.names`), else a custom model's (`State.custom_cards`, by the names
    no catalog card claims), else a local model directory.

    Raises:
        UnknownModelError: neither a built-in id, a custom model nor an existing directory.
        ValueError: the directory exists but is not a loadable model (see
            `card_from_local_directory`).
    """
    resolved = resolve_model_name(model_id, builtin, custom_cards=custom)
    if resolved is not None:
        return builtin[resolved] if resolved in builtin else (custom or {})[resolved]
    candidate = Path(model_id).expanduser() if model_id else None
    if candidate is not None and candidate.is_dir():
        return card_from_local_directory(candidate)
    raise UnknownModelError(
        f"unknown model {str(model_id)!r}: not in the catalog, not a custom model and not an "
        f"existing local model directory{_closest_names(model_id, builtin, custom or {})}; "
        "GET /models lists every model"
    )


def _closest_names(
    model_id: str, builtin: Mapping[ModelId, ModelCard], custom: Mapping[ModelId, ModelCard]
) -> str:
    """` (closest: qwen3:0.6b, ...)`: for up to `CLOSEST_NAMES` known cards that one of
    their names (`names.card_names`) looks like the mistyped `model_id` (difflib's ratio, at
    least 0.6), the closest such name, best first; "" when none does. Listing the whole
    catalog instead buried the one a typo missed among some sixty ids."""
    owners: dict[str, ModelId] = {}
    for card in with_custom_cards(builtin, custom).values():
        for name in card_names(card):
            owners.setdefault(name, card.model_id)
    closest: dict[ModelId, str] = {}
    for name in difflib.get_close_matches(model_id.lower(), owners, n=len(owners)):
        closest.setdefault(owners[name], name)
        if len(closest) == CLOSEST_NAMES:
            break
    return f" (closest: {', '.join(closest.values())})" if closest else ""
