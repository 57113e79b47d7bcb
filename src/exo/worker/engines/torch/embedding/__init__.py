"""Embeddings and rerank scores from a loaded model (`backend.EmbeddingBackend`)."""
