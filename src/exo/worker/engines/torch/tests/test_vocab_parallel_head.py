"""A tensor rank's share of the LM head (`sharding.split_head_by_vocab`): each rank's rows
of every head kind, which together are the whole head's outputs."""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from exo.worker.engines.torch.comm.parallel_linears import VocabParallelHead
from exo.worker.engines.torch.comm.tcp_mesh import RankLinks
from exo.worker.engines.torch.model.sharding import split_head_by_vocab
from exo.worker.engines.torch.quant.int4_groups import Int4Linear
from exo.worker.engines.torch.quant.int4_planes import SplitInt4Linear
from exo.worker.engines.torch.quant.int8_blocks import ScaledInt8Linear
from exo.worker.engines.torch.quant.int8_channels import Int8Linear
from exo.worker.engines.torch.quant.native_kernels import NATIVE_INT4_ENV

VOCAB, HIDDEN = 200, 64


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)


class _Model(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = head


def _heads() -> dict[str, nn.Module]:
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(HIDDEN, VOCAB, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator))
        linear.bias.copy_(torch.randn(VOCAB, generator=generator))
    values = torch.randint(-128, 128, (VOCAB, HIDDEN), generator=generator)
    scales = torch.rand(VOCAB, HIDDEN // 32, generator=generator) * 0.01
    return {
        "dense": linear,
        "int8": Int8Linear(linear),
        "int4": Int4Linear(nn.Linear(HIDDEN, 256, bias=False)),
        "int8-blocks": SplitInt4Linear(values[:192], scales[:192], -scales[:192], None),
        "int8-scaled": ScaledInt8Linear(values[:200], scales[:200], None, 32),
    }


@pytest.mark.parametrize("layout", ["native", "torch"])
@pytest.mark.parametrize("kind", ["dense", "int8", "int4", "int8-blocks", "int8-scaled"])
def test_the_ranks_rows_are_the_whole_heads_outputs(
    kind: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both int4 layouts: exo's kernels' and torch's (blocked by 64 outputs; on CPUs without
    AVX512 torch's unpacking is refused and its fused kernel runs, sliced the same)."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1" if layout == "native" else "0")
    head = _heads()[kind]
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = head(x).float()
        pieces: list[torch.Tensor] = []
        for rank in range(2):
            model = _Model(copy.deepcopy(head))
            assert split_head_by_vocab(model, rank, 2)
            split = model.lm_head
            assert isinstance(split, VocabParallelHead)
            assert split.vocab == whole.shape[-1] and split.start == sum(
                piece.shape[-1] for piece in pieces
            )
            pieces.append(split.local(x).float())
    torch.testing.assert_close(torch.cat(pieces, dim=-1), whole, rtol=1e-5, atol=1e-5)


def test_a_head_tied_to_the_embedding_stays_whole() -> None:
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    model = _Model(head)
    head.weight = model.model.embed_tokens.weight
    assert not split_head_by_vocab(model, 0, 2)
    assert model.lm_head is head


def test_logits_gathered_over_rank_links_are_the_whole_heads(
    make_mesh: Callable[..., list[RankLinks]],
) -> None:
    """Each rank sends only its columns over the links (`VocabParallelHead.gather`): both
    ranks end with the whole head's logits (200 ids: 128 on rank 0, 72 on rank 1)."""
    head = _heads()["int8"]
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        whole = head(x).float()
    splits = []
    for rank in range(2):
        model = _Model(copy.deepcopy(head))
        assert split_head_by_vocab(model, rank, 2)
        assert isinstance(model.lm_head, VocabParallelHead)
        splits.append(model.lm_head)
    mesh = make_mesh(2)

    def gather(rank: int) -> torch.Tensor:
        with torch.inference_mode():
            local = splits[rank].local(x).float().contiguous()
            return splits[rank]._gather_over_links(local, mesh[rank])

    with ThreadPoolExecutor(2) as pool:
        gathered = list(pool.map(gather, range(2)))
    for logits in gathered:
        torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("vocab", "world_size"), [(64, 2), (200, 3)])
def test_a_vocabulary_too_small_for_every_rank_stays_whole_on_every_rank(
    vocab: int, world_size: int
) -> None:
    """Shares are multiples of 64 ids: 64 ids over 2 ranks (200 over 3) would leave the
    last rank none, so no rank splits (one that did would all-gather alone)."""
    head = nn.Linear(HIDDEN, vocab, bias=False)
    for rank in range(world_size):
        model = _Model(head)
        assert not split_head_by_vocab(model, rank, world_size)
        assert model.lm_head is head
