from __future__ import annotations

from exo.utils.omp import SPIN_COUNT, limit_thread_spinning


def test_spin_count_is_set_unless_the_user_did() -> None:
    environ: dict[str, str] = {}
    limit_thread_spinning(environ)
    assert environ == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    chosen = {"GOMP_SPINCOUNT": "infinite"}
    limit_thread_spinning(chosen)
    assert chosen == {"GOMP_SPINCOUNT": "infinite"}
