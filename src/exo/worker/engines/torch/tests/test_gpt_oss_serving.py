"""A gpt-oss checkout served end to end (engine, then exo's output parser): the harmony
format's stop tokens end generation whatever the generation config names, and harmony's
markers never reach the answer or reasoning text, even when `logit_bias` forces them.

The checkout is tiny and random (a byte-level tokenizer with harmony's special tokens and a
gpt-oss-shaped template, `exo.testing.chat_formats`), its generation config naming only
`<|return|>` as EOS, as the trial checkout that showed the bug did.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from exo.chat_protocol.harmony import CALL, CHANNEL, CONSTRAIN, HARMONY_TOKENS, MESSAGE, START
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.chat_formats import GPT_OSS_LIKE, byte_tokenizer
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.parsed_generation import OutputPiece
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.engine_factory import load_engine
from exo.worker.engines.torch.tests.test_distributed import make_shard
from exo.worker.runner.generation_feed import parsed_output

MODEL = ModelId("openai/gpt-oss-20b")
FORCED = 100.0  # a logit bias no random logit comes near


@dataclass(frozen=True)
class GptOss:
    engine: TorchEngine
    ids: dict[str, int]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> GptOss:
    tokenizer = byte_tokenizer([*HARMONY_TOKENS, "<|endoftext|>"], GPT_OSS_LIKE)
    ids = {marker: tokenizer.convert_tokens_to_ids(marker) for marker in HARMONY_TOKENS}
    directory = save_tiny_model(
        tmp_path_factory.mktemp("gpt-oss-serving"), "gpt_oss", None, n_layers=2,
        tie_word_embeddings=False, vocab_size=len(tokenizer),
        eos_token_id=ids["<|return|>"],
    )  # fmt: skip
    tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(GPT_OSS_LIKE)
    engine = load_engine(directory, make_shard(directory, "pipeline", 0, 1))
    return GptOss(engine, ids)


def serve(engine: TorchEngine, bias: dict[int, float], max_tokens: int) -> list[OutputPiece]:
    """One chat through the engine and the output parser the runner uses."""
    params = TextGenerationTaskParams(
        model=MODEL,
        messages=(ChatMessage(role="user", content="Hi"),),
        temperature=0.0,
        max_tokens=max_tokens,
        logit_bias=bias,
    )
    prompt = engine.render_prompt(params)
    assert prompt.tool_call_format == "harmony"
    feed, parsed = parsed_output(params, prompt)
    outputs: list[OutputPiece] = []
    for piece in engine.generate(params, prompt):
        feed.piece = piece
        outputs.append(next(parsed))
    return outputs


def test_call_and_return_end_generation_whatever_the_generation_config_says(
    gpt_oss: GptOss,
) -> None:
    assert {gpt_oss.ids["<|call|>"], gpt_oss.ids["<|return|>"]} <= gpt_oss.engine.eos_token_ids
    outputs = serve(gpt_oss.engine, {gpt_oss.ids[CALL]: FORCED}, max_tokens=8)
    assert outputs[-1].finish_reason == "stop"
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 1
    assert "".join(output.text for output in outputs) == ""


@pytest.mark.parametrize("marker", [CHANNEL, MESSAGE, START, CONSTRAIN])
def test_forced_markers_never_reach_content_or_reasoning(gpt_oss: GptOss, marker: str) -> None:
    outputs = serve(gpt_oss.engine, {gpt_oss.ids[marker]: FORCED}, max_tokens=6)
    assert outputs[-1].finish_reason == "length"
    assert "".join(output.text for output in outputs) == ""
    assert "".join(output.reasoning_text for output in outputs) == ""
