"""Embeddings and rerank: OpenAI `/v1/embeddings`, Ollama `/api/embed` and `/api/embeddings`,
Jina / Cohere `/v1/rerank`."""
