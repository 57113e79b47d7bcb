"""Checkpoints that stack a MoE layer's experts in a few tensors (gpt-oss's
`mlp.experts.gate_up_proj` `[experts, hidden, 2 * intermediate]` with gate and up
interleaved along the last dimension, `down_proj` `[experts, intermediate, hidden]`, and
their `_bias` tensors; `families.spec.FusedExpertTensors`), read into the engine's one
linear per expert (`moe.RoutedExperts`: `experts.N.gate_proj.weight` `[intermediate,
hidden]`, ...).

The loader plans one read per expert linear (`FusedExperts.targets`): an expert-parallel
rank plans only its experts', and each read takes only that expert's rows of the stacked
tensor (`FusedExperts.cut`: `[e : e + 1]` along the first dimension, a contiguous range of
the file), so the other experts' bytes are never read. The cut expert is then handed to the
parallelism's reader like any checkpoint tensor (a tensor rank takes its rows / columns).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from exo.worker.engines.torch.model.families.spec import MixtureOfExperts

# An expert's tensor in the model: (experts module path, expert id, linear, weight|bias).
_EXPERT_TARGET = re.compile(
    r"^(model\.layers\.\d+\..+)\.(\d+)\.([^.]+)\.(weight|bias|blocks|scales)$"
)


class TensorSlice:
    """An in-memory tensor with the part of safetensors' slice interface the parallelisms'
    readers use (`get_shape()`, indexing), so a cut expert reads like a stored tensor."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


@dataclass(frozen=True, slots=True)
class FusedExperts:
    """One model's fused expert layout: its family's `MixtureOfExperts` (with
    `fused_checkpoint`), the number of routed experts per MoE layer, and whether the
    checkpoint stores them as MXFP4 (`<name>_blocks` / `<name>_scales`, output-major,
    read into `Mxfp4Linear`s' `blocks` / `scales`) instead of float."""

    moe: MixtureOfExperts
    experts: int
    mxfp4: bool = False

    def _stored(self) -> dict[str, tuple[str, ...]]:
        """Stored tensor name (relative to the experts module) -> the expert linears cut
        from it."""
        fused = self.moe.fused_checkpoint
        assert fused is not None
        gate, up = self.moe.expert_gate_up
        down = self.moe.expert_down
        stored: dict[str, tuple[str, ...]] = {}
        if self.mxfp4:
            for suffix in ("_blocks", "_scales"):
                stored[fused.gate_up + suffix] = (gate, up)
                stored[fused.down + suffix] = (down,)
        else:
            stored = {fused.gate_up: (gate, up), fused.down: (down,)}
        if self.moe.expert_bias:
            stored[f"{fused.gate_up}_bias"] = (gate, up)
            stored[f"{fused.down}_bias"] = (down,)
        return stored

    def stacks(self, name: str) -> bool:
        """Whether checkpoint (or model) tensor `name` is a stacked expert tensor."""
        _, found, stored = name.rpartition(f".{self.moe.experts}.")
        return bool(found) and stored in self._stored()

    def targets(self, name: str) -> list[str]:
        """The model tensors cut from model-named tensor `name` (layers already renumbered
        to this rank's), or `[name]` for a tensor that is not a stacked expert tensor.

        `model.layers.0.mlp.experts.gate_up_proj` → `model.layers.0.mlp.experts.N.
        gate_proj.weight` and `...N.up_proj.weight` for every expert N."""
        head = f".{self.moe.experts}."
        owner, found, stored = name.rpartition(head)
        linears = self._stored().get(stored) if found else None
        if linears is None or not owner.startswith("model.layers."):
            return [name]
        kind = "weight"
        for suffix in ("bias", "blocks", "scales"):
            if stored.endswith(f"_{suffix}"):
                kind = suffix
        base = f"{owner}{head}"
        return [
            f"{base}{expert}.{linear}.{kind}"
            for expert in range(self.experts)
            for linear in linears
        ]

    def cut(self, stored_name: str, target: str, stored: Any) -> TensorSlice:
        """Expert `target`'s tensor out of the stacked checkpoint tensor `stored_name`
        (`stored`: its safetensors slice; only the expert's rows are read).

        Returns:
            The expert linear's weight `[out, in]`, bias `[out]`, or MXFP4 blocks `[out,
            in / 32, 16]` / scales `[out, in / 32]`, as a `TensorSlice`.

        Raises:
            ValueError: `target` is not an expert tensor, or the stored tensor's shape is
                not the stacked layout (names the tensor).
        """
        match = _EXPERT_TARGET.match(target)
        if match is None:
            raise ValueError(f"{target} is not an expert's tensor (cut from {stored_name})")
        expert, linear, kind = int(match.group(2)), match.group(3), match.group(4)
        shape = list(stored.get_shape())
        if not shape or shape[0] <= expert:
            raise ValueError(
                f"{stored_name} has shape {shape}: no expert {expert} in it (expected "
                f"[{self.experts}, ...])"
            )
        part: torch.Tensor = stored[expert : expert + 1][0]
        gate, up = self.moe.expert_gate_up
        output_major = kind in ("blocks", "scales")  # MXFP4: [out, groups, ...]
        if linear in (gate, up):  # gate at even, up at odd outputs
            start = 0 if linear == gate else 1
            part = part[start::2] if output_major else part[..., start::2]
        if kind == "weight":
            part = part.transpose(0, 1)  # input-major → [out, in]
        return TensorSlice(part.contiguous())
