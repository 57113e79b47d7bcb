"""Marks a model directory the tests built with the engine's test seam
(`exo.worker.engines.torch.testing_seam`): its runner then prefills slowly or answers chosen
prompts with chosen text, on a live node and through every API dialect.

Example: a node serving `model_dir` marked with
`mark_model_dir(model_dir, replies=[("read the file", '<tool_call>{"name": "Read", ...}')])`
answers any prompt containing "read the file" with that tool call, so an agent client runs
the tool and sends its result back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from exo.worker.engines.torch.testing_seam import SEAM_FILE, ScriptedRule, TestingSeam


def mark_model_dir(
    model_dir: Path,
    *,
    prefill_chunk_seconds: float = 0.0,
    decode_step_seconds: float = 0.0,
    replies: Sequence[tuple[str, str]] = (),
) -> Path:
    """Write the seam's marker into `model_dir` (replacing any earlier one); the path written.

    Args:
        prefill_chunk_seconds: each step that prefills a prompt chunk sleeps this long.
        decode_step_seconds: each step that decodes sleeps this long.
        replies: `(prompt_contains, reply)` rules, the first match deciding.
    """
    seam = TestingSeam(
        prefill_chunk_seconds=prefill_chunk_seconds,
        decode_step_seconds=decode_step_seconds,
        replies=tuple(ScriptedRule(prompt_contains=key, reply=text) for key, text in replies),
    )
    path = model_dir / SEAM_FILE
    temporary = path.with_suffix(".tmp")
    temporary.write_text(seam.model_dump_json(indent=2), encoding="utf-8")
    temporary.replace(path)
    return path


def unmark_model_dir(model_dir: Path) -> None:
    """Remove the seam's marker (the model answers as itself again at its next load)."""
    (model_dir / SEAM_FILE).unlink(missing_ok=True)
