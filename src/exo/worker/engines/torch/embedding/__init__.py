"""Embedding and reranking models: the `EmbeddingBackend` protocol the runner calls, decoder
models pooled (`decoder.py`), and exo's own forward code for encoder families (BERT,
NomicBERT, XLM-RoBERTa, a cross-encoder head) and EmbeddingGemma, loaded from a
sentence-transformers / Hugging Face model directory."""
