"""A GGUF model's tokenizer, split the way its Hugging Face tokenizer splits.

A GGUF with a byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2") names its
pre-tokenization by `tokenizer.ggml.pre`, and transformers' GGUF tokenizer conversion sets
the split pattern for the names it knows (`GGUF_PRE_TOKENIZER_SPLITS` in
`transformers.integrations.gguf.gguf_tokenizer_mapping`, 5.25). For any other name it keeps
GPT-2's split (`'s|'t|... ?\\p{L}+| ?\\p{N}+|...`), so digits stay one run and CJK joins
the letters: the model then gets token ids its Hugging Face tokenizer never makes. The
families of exo's MoE cards that this hits (`PRE_TOKENIZER_SPLITS`), their patterns being
the facts of llama.cpp's `llama-vocab.cpp` (`tokenizer_pre` → pre type → `regex_exprs`)
and of the models' own tokenizers:

- **deepseek-v3** (DeepSeek-V3 / V3.1 / R1, `LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM`; the
  `pre_tokenizer` of deepseek-ai/DeepSeek-V3's `tokenizer.json`): three splits applied in
  turn, each keeping what it matches and what lies between as pieces: digit runs of up to
  three; runs of CJK ideographs (U+4E00–U+9FA5), hiragana and katakana; then one
  punctuation mark with the ASCII letters after it, letter/mark runs with at most one
  leading non-letter, non-punctuation, non-symbol character, punctuation/symbol runs,
  newlines and spaces.
- **kimi-k2** (Kimi-K2, `LLAMA_VOCAB_PRE_TYPE_KIMI_K2`): the pattern of Moonshot's
  `tokenization_kimi.py`, `exo.chat_protocol.tokenizer_loading.KIMI_PATTERN` (the one exo
  already uses for Kimi's TikToken files): Han runs apart, letter runs split at a
  lower-to-upper case change with English contractions attached, digits in threes.
- **glm4** (GLM-4.5 / 4.6 / 4.7, and "chatglm-bpe"; `LLAMA_VOCAB_PRE_TYPE_CHATGLM4`; the
  `pre_tokenizer` of zai-org/GLM-4.5's `tokenizer.json`): Llama 3's split,
  case-insensitive contractions, letter runs with one leading non-letter, digits in
  threes.

Every pattern is applied by `tokenizers`' `Split` (Oniguruma, which reads `\\p{Han}` and
the `&&` class intersections of Kimi's) with behaviour "isolated", then the byte-level
mapping without its own regex, the shape of the models' `tokenizer.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exo.chat_protocol.tokenizer_loading import KIMI_PATTERN

# deepseek-v3: digits, then CJK / kana runs, then the rest (three `Split`s in this order).
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
    r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# glm4: Llama 3's pattern (case-insensitive contractions, digits in threes).
GLM4_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` → the regex splits applied in order (module docstring).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": DEEPSEEK_V3_SPLITS,
    "kimi-k2": (KIMI_PATTERN,),
    "glm4": (GLM4_SPLIT,),
    "chatglm-bpe": (GLM4_SPLIT,),
}


def set_pre_tokenizer_splits(tokenizer: Any, pre_tokenizer: object) -> bool:
    """Give `tokenizer` (a fast tokenizer built from a GGUF) the splits of
    `PRE_TOKENIZER_SPLITS[pre_tokenizer]` (`pre_tokenizer`: the file's `tokenizer.ggml.pre`)
    followed by the byte-level mapping; any other value leaves it as transformers built it.

    Returns:
        Whether the pre-tokenizer was replaced.
    """
    splits = PRE_TOKENIZER_SPLITS.get(pre_tokenizer) if isinstance(pre_tokenizer, str) else None
    if splits is None:
        return False
    from tokenizers import Regex, pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return True


def load_gguf_tokenizer(gguf_path: Path, pre_tokenizer: object, read_config: bool) -> Any:
    """The fast tokenizer of the GGUF at `gguf_path` (the first part of a split one), with
    its `tokenizer.ggml.pre` (`pre_tokenizer`) splits set (`set_pre_tokenizer_splits`).

    Args:
        read_config: through `AutoTokenizer`, which reads the file's config first to pick the
            tokenizer class; False for architectures transformers' GGUF config reader does
            not know (`PreTrainedTokenizerFast` directly).

    Raises:
        ValueError / OSError: from transformers for a file whose tokenizer it cannot read.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    reader: Any = AutoTokenizer if read_config else PreTrainedTokenizerFast
    tokenizer = reader.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    set_pre_tokenizer_splits(tokenizer, pre_tokenizer)
    return tokenizer
