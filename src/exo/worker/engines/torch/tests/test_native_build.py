"""Building exo's native kernels (`native_kernels`): where the build with this CPU's extra flags
(AVX512, VNNI) fails, e.g. a compiler too old for one of them, the AVX2 build is used."""

from __future__ import annotations

import pytest

from exo.worker.engines.torch.quant import native_kernels

pytestmark = pytest.mark.skipif(
    native_kernels.built_int4_kernel() is None, reason="exo's native kernels cannot be built here"
)


def test_a_failed_build_with_the_cpus_flags_falls_back_to_the_avx2_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = native_kernels._base_flags()
    monkeypatch.setattr(native_kernels, "_flags", lambda: [*base, "-mno-such-option-for-exo"])
    with pytest.raises(RuntimeError):
        native_kernels._built_library([*base, "-mno-such-option-for-exo"])
    library = native_kernels._built_library_for_this_cpu()
    assert library == native_kernels._built_library(base)
    assert library.exists()


def test_every_header_is_in_the_build_hash() -> None:
    """The built library's name carries a hash of the sources and `_HEADERS`: a header left
    out (moe_parallel.h was) could change without a rebuild, and a runner would load a
    library built from the old header."""
    native = native_kernels._NATIVE
    assert set(native.glob("*.h")) == set(native_kernels._HEADERS)
    assert set(native.glob("*.cpp")) == set(native_kernels._SOURCES)
