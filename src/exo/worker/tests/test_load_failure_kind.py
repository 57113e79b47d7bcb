"""Which failures to load or warm up a model are the model's own (`RunnerFailed.permanent`:
loading it again fails again, so its requests get a final error) and which may pass."""

import pytest
import torch

from exo.worker.runner.failures import load_failure, load_failure_is_permanent


@pytest.mark.parametrize(
    "error",
    [
        ValueError("tensor lm_head.weight has shape (64, 63), this rank's model expects (64, 64)"),
        KeyError("model.layers.0.self_attn.q_proj.weight"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (1x64 and 63x64)"),
        NotImplementedError("rope_scaling type 'unknown'"),
    ],
)
def test_an_error_of_the_model_is_permanent(error: Exception) -> None:
    assert load_failure_is_permanent(error)
    status = load_failure("warm-up", error)
    assert status.permanent and status.error_message == f"warm-up failed: {error}"


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
        ),
        OSError(28, "No space left on device"),
        FileNotFoundError("model.safetensors"),
        RuntimeError("Connection closed by peer [127.0.0.1]:40123"),
        torch.distributed.DistNetworkError("the store is gone"),
    ],
)
def test_a_failure_that_may_pass_is_not(error: Exception) -> None:
    assert not load_failure_is_permanent(error)
    assert not load_failure("loading", error).permanent
