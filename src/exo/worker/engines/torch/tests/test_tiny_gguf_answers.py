"""The tiny GGUF of the tests (`exo.testing.tiny_gguf.save_tiny_gguf`), converted as a node
converts a GGUF, loads and answers a chat. A new-user trial (2026-12-07) found its tokenizer
turning every text into no ids (a word-level vocabulary under byte-level BPE, no BOS): the
warm-up failed with an IndexError and the model never served."""

from pathlib import Path

from exo.download.gguf_models import card_for_gguf
from exo.download.gguf_repack import convert_gguf
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.tiny_gguf import save_tiny_gguf
from exo.worker.engines.torch.engine import TorchEngine


def test_the_tiny_gguf_converts_loads_and_answers(tmp_path: Path) -> None:
    gguf = save_tiny_gguf(tmp_path / "tiny.gguf")
    card = card_for_gguf(gguf, "mytiny:latest")
    directory = tmp_path / "converted"
    directory.mkdir()
    convert_gguf(gguf, directory)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(directory, shard, weight_dtype="float32")
    params = TextGenerationTaskParams(
        model=ModelId("mytiny:latest"),
        messages=(ChatMessage(role="user", content="Hello there!"),),
        temperature=0.0,
        max_tokens=4,
    )
    # One id per character (the template writes the content alone); a raw prompt gets
    # the BOS first, as Llama's tokenizer adds it.
    assert len(engine.render_prompt(params).token_ids) == len("Hello there!")
    raw = params.model_copy(update={"messages": (), "prompt": "Hello"})
    assert engine.render_prompt(raw).token_ids[0] == 1
    assert len(engine.render_prompt(raw).token_ids) == 1 + len("Hello")
    engine.warmup()
    final = list(engine.generate(params))[-1]
    assert final.usage is not None and final.usage.completion_tokens >= 1
