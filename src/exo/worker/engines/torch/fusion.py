"""Module swaps that cut per-token operator count in a loaded model (same math, fewer ops).

Decode of a small model on CPU spends as much time dispatching small operators as in the
matmuls, so replacing a multi-op module by a single fused kernel is measurable per token.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedRMSNorm(nn.Module):
    """`torch.nn.functional.rms_norm` (one kernel) in place of a float32 model's RMSNorm."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.eps = eps
        self._shape = (weight.shape[-1],)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(hidden_states, self._shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self._shape[0]}, eps={self.eps}"


def fuse_rms_norms(model: nn.Module, norm_classes: tuple[type[nn.Module], ...]) -> int:
    """Replace the float32 model's RMSNorm modules of `norm_classes` (a family file's
    `rms_norms`: classes computing `weight * (x.float() * rsqrt(mean(x.float()^2) + eps))
    .to(dtype)`, not Gemma's `1 + weight` variant) by `FusedRMSNorm` in place.

    Only float32 weights are swapped: the originals compute in float32 and cast back to
    the input dtype before scaling, which one float32 kernel reproduces exactly only then.

    Returns:
        the number of replaced modules.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) in norm_classes
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dtype == torch.float32
        and isinstance(getattr(module, "variance_epsilon", None), float)
    ]
    for name, module in targets:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, FusedRMSNorm(module.weight, module.variance_epsilon))
    return len(targets)
