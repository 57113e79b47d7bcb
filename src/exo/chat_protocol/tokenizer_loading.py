"""Loading a model directory's tokenizer, including Kimi's TikToken one, without its code.

Most checkpoints ship a `tokenizer.json` (or a SentencePiece `tokenizer.model`) that
transformers' `AutoTokenizer` reads by itself. Moonshot's Kimi models (Kimi-K2-Instruct and
its siblings) ship neither: their `tokenizer_config.json` names `TikTokenTokenizer` from the
repository's own `tokenization_kimi.py` (custom code, which exo never runs, needing the
`tiktoken` package) and the vocabulary is `tiktoken.model`, one `<base64 token bytes> <rank>`
line per BPE token. `load_tokenizer` builds the equivalent fast tokenizer from those data
files alone:

- the BPE: transformers' `TikTokenConverter` turns the ranks into a byte-level BPE whose
  merge order is the ranks' (tiktoken merges the adjacent pair whose concatenation has the
  lowest rank; a whole piece that is one token is taken as is, `ignore_merges`). exo reads
  the ranks file itself, so `tiktoken` is not needed.
- the pre-tokenization: the pattern that `tokenization_kimi.py` passes to tiktoken
  (`KIMI_PATTERN`, the facts of moonshotai/Kimi-K2-Instruct's file): Han runs apart,
  letter runs split at a lower-to-upper case change with English contractions attached,
  digits in runs of up to three, then GPT-4's punctuation and whitespace rules. Its
  `&&` class intersections are read by both tiktoken's Rust regex and the Oniguruma
  engine of `tokenizers`.
- the special tokens: the Kimi code numbers `num_reserved_special_tokens + 2` = 258 ids
  right after the ranks (for Kimi-K2, 163584 to 163841); an id named in
  `tokenizer_config.json`'s `added_tokens_decoder` gets that name (Kimi-K2: `[BOS]`
  163584, `[EOS]` 163585, `<|im_end|>` 163586, `<|im_user|>` 163587, `<|im_assistant|>`
  163588, `<|im_system|>` 163594, the tool-call markers 163595-163599, `<|im_middle|>`
  163601, `[UNK]` 163838, `[PAD]` 163839), the others `<|reserved_token_{id}|>`. Like
  tiktoken's `allowed_special="all"` in that code, their text in a prompt encodes to
  their id. One difference: ids at or past the embedding of the directory's `config.json`
  (`vocab_size`; Kimi-K2's 163840 leaves out 163840 and 163841, two unnamed reserved ids)
  are not made, so no prompt text becomes an id the model has no row for.
- `bos_token` / `eos_token` / `unk_token` / `pad_token` from `tokenizer_config.json`
  (the Kimi code's defaults `[BOS]` / `[EOS]`), no token added around an encoded text, and
  the chat template from `chat_template.jinja` or `tokenizer_config.json`.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TIKTOKEN_FILE = "tiktoken.model"
TIKTOKEN_TOKENIZER_CLASS = "TikTokenTokenizer"
# The module of the Kimi models' tokenizer code (`auto_map.AutoTokenizer` names it).
KIMI_TOKENIZER_MODULE = "tokenization_kimi"
# Ids numbered after the ranks by the Kimi code: its `num_reserved_special_tokens` (256)
# plus two.
KIMI_SPECIAL_TOKEN_COUNT = 256 + 2
# The pre-tokenization pattern of moonshotai/Kimi-K2-Instruct's `tokenization_kimi.py`
# (its `pat_str`, the eight alternatives joined by `|`).
_KIMI_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join(
    (
        r"[\p{Han}]+",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_KIMI_LETTERS_UPPER}*{_KIMI_LETTERS_LOWER}+{_CONTRACTIONS}",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_KIMI_LETTERS_UPPER}+{_KIMI_LETTERS_LOWER}*{_CONTRACTIONS}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)


def load_tokenizer(directory: Path) -> Any:
    """The tokenizer of the model in `directory`: Kimi's TikToken one built from its data
    files (`is_kimi_tiktoken`), any other through `AutoTokenizer` (never with the
    repository's code).

    Raises:
        ValueError: a Kimi `tiktoken.model` or `tokenizer_config.json` that does not parse
            (naming the file, line or field).
        OSError / ValueError: what `AutoTokenizer.from_pretrained` raises for the others.
    """
    if is_kimi_tiktoken(directory):
        return load_kimi_tiktoken(directory)
    from transformers import AutoTokenizer  # heavy import, only when first needed

    return AutoTokenizer.from_pretrained(str(directory))


def is_kimi_tiktoken(directory: Path) -> bool:
    """Whether `directory` holds a Kimi TikToken tokenizer and no `tokenizer.json`: a
    `tiktoken.model` and a `tokenizer_config.json` that `names_kimi_tokenizer`."""
    if (directory / "tokenizer.json").is_file() or not (directory / TIKTOKEN_FILE).is_file():
        return False
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return names_kimi_tokenizer(config)


def names_kimi_tokenizer(tokenizer_config: Any) -> bool:
    """Whether a `tokenizer_config.json`'s content names `TikTokenTokenizer` from
    `tokenization_kimi` (its `tokenizer_class` and `auto_map`): the code whose pattern and
    special-token numbering `load_kimi_tiktoken` reproduces."""
    if not isinstance(tokenizer_config, Mapping):
        return False
    if tokenizer_config.get("tokenizer_class") != TIKTOKEN_TOKENIZER_CLASS:
        return False
    auto_map = tokenizer_config.get("auto_map")
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, Mapping) else None
    names = entry if isinstance(entry, list) else [entry]
    return any(
        isinstance(name, str) and name.split(".")[0] == KIMI_TOKENIZER_MODULE for name in names
    )


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """The BPE ranks of a `tiktoken.model` file: one `<base64 token bytes> <rank>` line per
    token (blank lines skipped), the ranks exactly 0..n-1 (the Kimi code numbers its special
    tokens from n on).

    Raises:
        ValueError: a line that is not base64 and an integer, a repeated token, or ranks
            that are not 0..n-1, naming the file and line.
    """
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            fields = line.split()
            try:
                if len(fields) != 2:
                    raise ValueError("expected two fields")
                token = base64.b64decode(fields[0], validate=True)
                rank = int(fields[1])
            except (ValueError, binascii.Error) as error:
                raise ValueError(
                    f"{path.name} line {number}: not '<base64 token> <rank>' ({error})"
                ) from error
            if token in ranks or rank in seen_ranks or not token:
                raise ValueError(f"{path.name} line {number}: repeated or empty token or rank")
            ranks[token] = rank
            seen_ranks.add(rank)
    if seen_ranks != set(range(len(ranks))):
        raise ValueError(f"{path.name}: the ranks are not 0..{len(ranks) - 1}")
    return ranks


def load_kimi_tiktoken(directory: Path) -> Any:
    """A `PreTrainedTokenizerFast` equivalent to Kimi's `TikTokenTokenizer` for `directory`
    (see the module docstring for what is reproduced and from where).

    Returns:
        The tokenizer: `len` is the ranks plus 258, or `config.json`'s `vocab_size` when
        smaller; encoding adds no BOS/EOS.

    Raises:
        ValueError: an unreadable ranks file, an `added_tokens_decoder` id outside the
            258 special ids, past the embedding, without `content` or spelled as a BPE
            token, or a `bos_token` / `eos_token` / `unk_token` / `pad_token` that is not
            one of the special tokens.
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    ranks = read_tiktoken_ranks(directory / TIKTOKEN_FILE)

    def given_ranks(tiktoken_url: str) -> dict[bytes, int]:
        return ranks

    class _RanksConverter(TikTokenConverter):
        """The converter, fed exo's reading of the ranks instead of `tiktoken`'s."""

        load_tiktoken_bpe = staticmethod(given_ranks)

    backend = _RanksConverter(vocab_file=str(directory / TIKTOKEN_FILE), pattern=KIMI_PATTERN)
    backend_tokenizer = backend.converted()
    special_tokens = _kimi_special_tokens(config, len(ranks), _embedding_rows(directory))
    backend_tokenizer.add_tokens(
        [
            AddedToken(
                str(entry["content"]),
                special=bool(entry.get("special", True)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                single_word=bool(entry.get("single_word", False)),
                normalized=bool(entry.get("normalized", False)),
            )
            for entry in special_tokens
        ]
    )
    # Ids are given in order after the ranks (the contents are distinct, checked above),
    # unless a special token's text is already a BPE token's.
    for token_id, entry in enumerate(special_tokens, start=len(ranks)):
        if backend_tokenizer.token_to_id(str(entry["content"])) != token_id:
            raise ValueError(
                f"tokenizer_config.json: special token {entry['content']!r} ({token_id}) is "
                f"also a token of {TIKTOKEN_FILE}"
            )
    names = {str(entry["content"]) for entry in special_tokens}
    roles: dict[str, str] = {}
    for role, default in (
        ("bos_token", "[BOS]"),
        ("eos_token", "[EOS]"),
        ("unk_token", None),
        ("pad_token", None),
    ):
        value = config.get(role, default)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if value not in names:
            raise ValueError(f"tokenizer_config.json: {role} {value!r} is not a special token")
        roles[role] = value
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend_tokenizer,
        clean_up_tokenization_spaces=False,
        model_max_length=config.get("model_max_length", int(1e30)),
        **roles,
    )
    template = _chat_template(directory, config)
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.name_or_path = str(directory)
    return tokenizer


def _embedding_rows(directory: Path) -> int | None:
    """`config.json`'s `vocab_size` (or its `text_config`'s), None without one."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text_config = config.get("text_config")
    for source in (config, text_config if isinstance(text_config, dict) else {}):
        rows = source.get("vocab_size")
        if isinstance(rows, int) and not isinstance(rows, bool):
            return rows
    return None


def _kimi_special_tokens(
    config: dict[str, Any], base: int, embedding_rows: int | None
) -> list[dict[str, Any]]:
    """The special tokens the Kimi code numbers from `base` (the rank count), in id order:
    `added_tokens_decoder`'s entry for a named id, else `<|reserved_token_{id}|>`; 258 of
    them, fewer when the model's embedding (`embedding_rows`) ends before."""
    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise ValueError("tokenizer_config.json: added_tokens_decoder is not an object")
    named: dict[int, dict[str, Any]] = {}
    for key, entry in declared.items():
        try:
            token_id = int(key)
        except ValueError as error:
            raise ValueError(f"tokenizer_config.json: added_tokens_decoder id {key!r}") from error
        if not base <= token_id < base + KIMI_SPECIAL_TOKEN_COUNT:
            raise ValueError(
                f"tokenizer_config.json: added_tokens_decoder id {token_id} is outside the "
                f"special ids {base}..{base + KIMI_SPECIAL_TOKEN_COUNT - 1}"
            )
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"tokenizer_config.json: added_tokens_decoder {key} has no content")
        named[token_id] = entry
    end = base + KIMI_SPECIAL_TOKEN_COUNT
    if embedding_rows is not None and base < embedding_rows < end:
        end = embedding_rows
        past = sorted(token_id for token_id in named if token_id >= end)
        if past:
            raise ValueError(
                f"tokenizer_config.json: added_tokens_decoder id {past[0]} is past the "
                f"model's embedding (config.json vocab_size {embedding_rows})"
            )
    contents = [str(entry["content"]) for entry in named.values()]
    if len(set(contents)) != len(contents):
        raise ValueError("tokenizer_config.json: added_tokens_decoder names a token twice")
    return [
        named.get(token_id, {"content": f"<|reserved_token_{token_id}|>", "special": True})
        for token_id in range(base, end)
    ]


def _chat_template(directory: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template as transformers reads it: `chat_template.jinja` first, else
    `tokenizer_config.json`'s `chat_template` (a string, or a list of `{name, template}`
    turned into a dict)."""
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        return {
            str(item["name"]): str(item["template"])
            for item in template
            if isinstance(item, dict) and "name" in item and "template" in item
        }
    return None
