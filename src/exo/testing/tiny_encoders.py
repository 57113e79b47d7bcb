"""Tiny random-weight embedding and reranker models laid out like their Hub repositories, for
the encoder tests and the loopback Hub.

`save_tiny_embedding_model` writes a sentence-transformers folder (`modules.json`,
`sentence_bert_config.json`, `1_Pooling/config.json`, EmbeddingGemma's `2_Dense` / `3_Dense`,
`config.json`, `model.safetensors`, a word-level `tokenizer.json`) with the pooling of the real
model of each family: all-MiniLM-L6-v2 (BERT, mean), nomic-embed-text-v1.5 (NomicBERT, mean),
bge-m3 (XLM-RoBERTa, CLS), EmbeddingGemma (Gemma 3 bidirectional, mean, then 2 dense
projections and a normalization). `save_tiny_reranker` writes a bge-reranker-v2-m3-shaped
cross-encoder (XLM-RoBERTa with a one-logit classification head). Requires
sentence-transformers (a test dependency).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WORDS = 40
FAMILIES = ("bert", "nomic_bert", "xlm-roberta", "embeddinggemma")
# Each family's special tokens in id order, then the words `w0`.. ; (template of one text).
_SPECIAL = {
    "bert": (("[PAD]", "[UNK]", "[CLS]", "[SEP]"), "[CLS]", "[SEP]", "[PAD]", "[UNK]"),
    "nomic_bert": (("[PAD]", "[UNK]", "[CLS]", "[SEP]"), "[CLS]", "[SEP]", "[PAD]", "[UNK]"),
    "xlm-roberta": (("<s>", "<pad>", "</s>", "<unk>"), "<s>", "</s>", "<pad>", "<unk>"),
    "embeddinggemma": (("<pad>", "<eos>", "<bos>", "<unk>"), "<bos>", "<eos>", "<pad>", "<unk>"),
}
_SMALL: dict[str, Any] = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 48, "vocab_size": 4 + WORDS, "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    # Wider than the default 0.02: different inputs then pool (CLS too) to clearly different
    # vectors, and pairs score apart by more than the tests' tolerances.
    "initializer_range": 0.2,
}  # fmt: skip


def save_tokenizer(directory: Path, family: str) -> None:
    """A word-level tokenizer of `w0`..`w39` (other words: the unknown token) that wraps one
    text as `<first> ... <last>` and a pair as the family does (RoBERTa: `<s> a </s></s> b
    </s>`; BERT: `[CLS] a [SEP] b [SEP]`)."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    specials, first, last, pad, unknown = _SPECIAL[family]
    vocabulary = {token: index for index, token in enumerate(specials)}
    vocabulary.update({f"w{i}": len(specials) + i for i in range(WORDS)})
    tokenizer = Tokenizer(WordLevel(vocabulary, unk_token=unknown))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    pair = (
        f"{first} $A:0 {last} {last} $B:0 {last}"
        if family == "xlm-roberta"
        else f"{first} $A:0 {last} $B:1 {last}:1"
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}",
        pair=pair,
        special_tokens=[(token, vocabulary[token]) for token in {first, last}],
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": pad,
        "unk_token": unknown,
        "model_max_length": 512,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _transformers_model(family: str, seed: int, hidden_size: int = 32) -> Any:
    import torch
    from transformers import (
        BertConfig,
        BertModel,
        Gemma3TextConfig,
        Gemma3TextModel,
        NomicBertConfig,
        NomicBertModel,
        XLMRobertaConfig,
        XLMRobertaModel,
    )

    torch.manual_seed(seed)
    small = {**_SMALL, "hidden_size": hidden_size}
    match family:
        case "bert":
            return BertModel(BertConfig(**small, pad_token_id=0), add_pooling_layer=False)
        case "nomic_bert":
            return NomicBertModel(NomicBertConfig(**small, pad_token_id=0))
        case "xlm-roberta":
            roberta = XLMRobertaConfig(
                **_SMALL, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                max_position_embeddings=40, type_vocab_size=1,
            )  # fmt: skip
            return XLMRobertaModel(roberta, add_pooling_layer=False)
        case "embeddinggemma":
            config = Gemma3TextConfig(
                vocab_size=4 + WORDS, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                # A window of 6 (3 either side) that short inputs overrun.
                sliding_window=6, use_bidirectional_attention=True,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                pad_token_id=0, eos_token_id=1, bos_token_id=2, max_position_embeddings=256,
            )  # fmt: skip
            model = Gemma3TextModel(config)
            # Random norm weights, so that the `1 + weight` offset matters.
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if "norm" in name:
                        parameter.normal_(0.0, 0.5)
            return model
    raise ValueError(f"unknown family {family}")


def save_tiny_embedding_model(
    directory: Path, family: str, seed: int = 0, hidden_size: int = 32
) -> Path:
    """A sentence-transformers model folder of `family` (one of `FAMILIES`) with random
    weights, saved by sentence-transformers itself. `hidden_size` (BERT and NomicBERT only)
    widens the model, e.g. to the 768 of nomic-embed-text's Matryoshka widths.

    Returns:
        `directory`.
    """
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    base = directory / "base"
    base.mkdir(parents=True, exist_ok=True)
    if hidden_size != 32 and family not in ("bert", "nomic_bert"):
        raise ValueError(f"hidden_size applies to bert and nomic_bert, not {family}")
    model = _transformers_model(family, seed, hidden_size)
    model.save_pretrained(str(base))
    save_tokenizer(base, family)
    transformer = Transformer(str(base), max_seq_length=128)
    modes = {"xlm-roberta": "cls"}
    modules: list[Any] = [transformer, Pooling(hidden_size, modes.get(family, "mean"))]
    if family == "embeddinggemma":
        modules += [
            Dense(32, 64, bias=False, activation_function=torch.nn.Identity()),
            Dense(64, 32, bias=False, activation_function=torch.nn.Identity()),
        ]
    if family in ("bert", "embeddinggemma"):
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(directory))
    for path in base.iterdir():
        path.unlink()
    base.rmdir()
    return directory


_ONE_LABEL: dict[str, Any] = {"num_labels": 1}


def save_tiny_reranker(directory: Path, seed: int = 0) -> Path:
    """A bge-reranker-v2-m3-shaped cross-encoder: `XLMRobertaForSequenceClassification` with
    one label, its config, weights and tokenizer (saved by transformers).

    Returns:
        `directory`.
    """
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    torch.manual_seed(seed)
    config = XLMRobertaConfig(
        **_SMALL, pad_token_id=1, bos_token_id=0, eos_token_id=2, max_position_embeddings=40,
        type_vocab_size=1, **_ONE_LABEL,
    )  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    XLMRobertaForSequenceClassification(config).save_pretrained(str(directory))
    save_tokenizer(directory, "xlm-roberta")
    return directory
