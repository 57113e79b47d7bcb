"""A runner's KV-cache budget from its instance's and its node's options (`runner_options_for`)."""

from __future__ import annotations

from exo.worker.main import runner_options_for
from exo.worker.runner.options import RunnerOptions


def test_the_instance_budget_bounded_by_the_node_and_counted_in_its_kv_dtype() -> None:
    default = RunnerOptions()
    assert runner_options_for(default, None) is default
    assert runner_options_for(default, 20_000).kv_cache_tokens == 20_000
    bounded = RunnerOptions(kv_cache_tokens=4_096)
    assert runner_options_for(bounded, 20_000).kv_cache_tokens == 4_096
    # Placement reserved 20,000 bfloat16 tokens' bytes: float32 KV holds half the tokens.
    float32 = RunnerOptions(kv_cache_dtype="float32")
    assert runner_options_for(float32, 20_000).kv_cache_tokens == 10_000
    both = RunnerOptions(kv_cache_dtype="float32", kv_cache_tokens=8_192)
    assert runner_options_for(both, 20_000).kv_cache_tokens == 8_192
    assert runner_options_for(both, 12_000).kv_cache_tokens == 6_000
