"""The model families the engine runs, one file each; `family_for_architecture` finds one.

Adding a family: write `<family>.py` with a `FAMILY = ModelFamily(...)`, list it in
`FAMILIES` (and its architecture names in `exo.shared.models.architectures`); the
registry-driven tests then build its tiny model and check single, pipeline and
tensor-parallel generation agree (and expert-parallel, for a family with `moe`).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from exo.worker.engines.torch.model.families import (
    deepseek_v3,
    gemma,
    gemma3,
    glm4_moe,
    gpt_oss,
    llama,
    minimax_m2,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from exo.worker.engines.torch.model.families.spec import ModelFamily, UnsupportedArchitectureError

FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mistral.FAMILY,
    phi3.FAMILY,
    gemma.FAMILY,
    gemma3.FAMILY,
    qwen3_moe.FAMILY,
    glm4_moe.FAMILY,
    mixtral.FAMILY,
    minimax_m2.FAMILY,
    gpt_oss.FAMILY,
    deepseek_v3.FAMILY,
)


def supported_architectures() -> tuple[str, ...]:
    """Every config `architectures` name some family file covers."""
    return tuple(
        name
        for family in FAMILIES
        for name in (*family.architectures, *family.wrapped_architectures)
    )


def family_for_architecture(architecture: str) -> ModelFamily:
    """The family whose file covers `architecture` (a config `architectures` entry).

    Raises:
        UnsupportedArchitectureError: no family file covers it (the message names it and
            the supported ones).
    """
    for family in FAMILIES:
        if architecture in family.architectures or architecture in family.wrapped_architectures:
            return family
    raise UnsupportedArchitectureError(
        f"architecture {architecture!r} has no model family file in this engine; "
        f"supported: {', '.join(supported_architectures())}"
    )


def family_by_name(name: str) -> ModelFamily:
    """The family called `name` (`ModelFamily.name`, e.g. "qwen3").

    Raises:
        KeyError: no such family.
    """
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"no model family {name!r}; known: {[f.name for f in FAMILIES]}")


def config_architecture(config: PretrainedConfig) -> str:
    """The architecture a checkpoint's config declares (its first `architectures` entry).

    Raises:
        UnsupportedArchitectureError: the config names none.
    """
    names = getattr(config, "architectures", None)
    if not names:
        raise UnsupportedArchitectureError(
            f"the {type(config).__name__} config has no architectures field; "
            "cannot tell which model family it is"
        )
    return str(names[0])


__all__ = [
    "FAMILIES",
    "ModelFamily",
    "UnsupportedArchitectureError",
    "config_architecture",
    "family_by_name",
    "family_for_architecture",
    "supported_architectures",
]
