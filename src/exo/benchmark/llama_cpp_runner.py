"""llama.cpp (its Python binding, llama-cpp-python) on a GGUF file, timed like exo: a random
prompt of token ids is evaluated, then greedy decoding with every EOS id banned runs for
exactly the asked number of tokens, through the binding's low-level `eval` (no sampler
chain, no detokenising), so both engines decode the same counts."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from exo.benchmark.stats import RequestTiming, RunResult


class LlamaCppMissingError(RuntimeError):
    """llama-cpp-python is not installed."""


@contextlib.contextmanager
def _model_params_without_extra_buffer_types(binding: Any) -> Iterator[None]:
    """Make the binding's default model parameters set `use_extra_bufts = False` while a
    model loads: the binding's `Llama()` has no argument for it, and on CPUs with AMX the
    extra (repacking) buffer types crashed in decode on the reference machine."""
    original = binding.llama_model_default_params

    def patched() -> Any:
        params = original()
        params.use_extra_bufts = False
        return params

    binding.llama_model_default_params = patched
    try:
        yield
    finally:
        binding.llama_model_default_params = original


class LlamaCppRunner:
    """One llama.cpp model on the CPU, `threads` threads for prefill and decode."""

    def __init__(
        self,
        gguf_path: Path,
        threads: int,
        context_tokens: int,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        """Load the GGUF. `settings`: other `llama_cpp.Llama` arguments, or these replaced
        (`flash_attn`, `type_k`, `n_batch`, ...).

        Raises:
            LlamaCppMissingError: llama-cpp-python is not installed.
        """
        try:
            import llama_cpp
            from llama_cpp import llama_cpp as binding
        except ImportError as error:
            raise LlamaCppMissingError(
                f"--compare-llama-cpp needs llama-cpp-python ({error}); install it, e.g. "
                "CMAKE_ARGS='-DGGML_NATIVE=ON' pip install llama-cpp-python==0.3.36"
            ) from None
        self.threads = threads
        with _model_params_without_extra_buffer_types(binding):
            arguments: dict[str, Any] = {
                "n_ctx": context_tokens,
                "n_batch": min(512, context_tokens),
                "n_threads": threads,
                "n_threads_batch": threads,
                "n_gpu_layers": 0,
                "logits_all": False,
                "verbose": False,
            }
            arguments.update(settings or {})
            self.model = llama_cpp.Llama(model_path=str(gguf_path), **arguments)
        self.vocab_size = int(self.model.n_vocab())
        eos = {int(self.model.token_eos())}
        with contextlib.suppress(AttributeError):
            eot = int(binding.llama_vocab_eot(self.model._model.vocab))
            if eot >= 0:
                eos.add(eot)
        self.eos_token_ids = frozenset(eos)

    def _greedy(self) -> int:
        import numpy

        logits = numpy.ctypeslib.as_array(
            self.model._ctx.get_logits(), shape=(self.vocab_size,)
        ).copy()
        logits[list(self.eos_token_ids)] = -numpy.inf
        return int(numpy.argmax(logits))

    def run(self, prompt_ids: list[int], generation_tokens: int) -> RunResult:
        """Prefill `prompt_ids`, then decode `generation_tokens` greedy tokens (the first
        comes from the prefill's logits, as exo's first streamed token)."""
        self.model.reset()
        origin = time.perf_counter()
        self.model.eval(prompt_ids)
        token = self._greedy()
        first = time.perf_counter() - origin
        for _ in range(generation_tokens - 1):
            self.model.eval([token])
            token = self._greedy()
        last = time.perf_counter() - origin
        return RunResult(
            requests=[
                RequestTiming(
                    prompt_tokens=len(prompt_ids),
                    completion_tokens=generation_tokens,
                    submitted_s=0.0,
                    first_token_s=first,
                    last_token_s=last,
                    finish_reason="length",
                )
            ]
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.model.close()


def default_threads() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
