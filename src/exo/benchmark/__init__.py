"""`exo bench`: prefill / decode speed, TTFT and peak memory of placements served by exo
nodes (a running cluster or fresh local ones), optionally against llama.cpp on the same GGUF."""
