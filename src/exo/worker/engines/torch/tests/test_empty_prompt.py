"""A chat request whose template renders to no tokens is refused at submit (a 400), and a
step that fails leaves nothing of its batch behind.

Found by a new-user trial (2026-12-07): `POST /v1/chat/completions` with `"messages":
[{"role": "user", "content": ""}]` to a model whose chat template writes only the messages'
content (`{% for m in messages %}{{ m.content }}{% endfor %}`) and whose tokenizer adds no
BOS (SmolLM2's) gave a 500 "list index out of range" (`step_layout.lay_out_step`:
`running.tokens[-1]`), and every later request to that instance failed the same way while it
stayed `RunnerReady`: the request that broke the step was never dropped from the scheduler.
"""

from typing import Any

import pytest

from exo.chat_protocol.prompt import RenderedPrompt
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.batching import scheduler as scheduler_module
from exo.worker.engines.torch.engine import TorchEngine


def request(content: str, **fields: Any) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content=content),), **fields
    )


def empty_prompt() -> RenderedPrompt:
    """What such a template renders for an empty message: no text, no tokens."""
    return RenderedPrompt(
        token_ids=[], text="", tool_call_format="hermes", thinking_open=False,
        tools_in_template=False,
    )  # fmt: skip


def test_a_prompt_of_no_tokens_is_refused_at_submit(tiny_engine: TorchEngine) -> None:
    # A ValueError is the request's fault: the runner answers it with a 400 in the
    # request's dialect (`failures.generation_failure`), as an empty raw prompt is.
    with pytest.raises(ValueError, match="prompt cannot be empty"):
        tiny_engine.submit(request(""), empty_prompt(), request_id="empty")
    assert not tiny_engine.has_work


def test_a_step_that_fails_outside_the_forward_pass_drops_its_batch(
    tiny_engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`TorchEngine.step`'s contract: when it raises, every running request is dropped, so
    the next request runs as on a fresh engine. The failure here is in laying out the step
    (where the empty prompt's IndexError was), not in the forward pass."""
    lay_out_step = scheduler_module.lay_out_step
    calls = 0

    def failing_once(*arguments: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise IndexError("list index out of range")
        return lay_out_step(*arguments)

    monkeypatch.setattr(scheduler_module, "lay_out_step", failing_once)
    tiny_engine.submit(request("Hi"), request_id="broken")
    with pytest.raises(IndexError):
        tiny_engine.step()
    assert not tiny_engine.has_work, "the request that broke the step is still scheduled"
    assert tiny_engine.kv_cache_usage() == (0, 0, tiny_engine.scheduler.budget_tokens)
    final = list(tiny_engine.generate(request("Hello", temperature=0.0, max_tokens=3)))[-1]
    assert final.usage is not None and final.usage.completion_tokens == 3
