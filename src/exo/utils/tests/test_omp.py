from __future__ import annotations

from pathlib import Path

from exo.utils.omp import SPIN_COUNT, cpu_vendor, limit_thread_spinning


def test_spin_count_is_set_on_amd_unless_the_user_did() -> None:
    environ: dict[str, str] = {}
    limit_thread_spinning(environ, vendor="AuthenticAMD")
    assert environ == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    chosen = {"GOMP_SPINCOUNT": "infinite"}
    limit_thread_spinning(chosen, vendor="AuthenticAMD")
    assert chosen == {"GOMP_SPINCOUNT": "infinite"}


def test_other_cpus_keep_libgomp_s_default() -> None:
    for vendor in ("GenuineIntel", "unknown-maker"):
        environ: dict[str, str] = {}
        limit_thread_spinning(environ, vendor=vendor)
        assert environ == {}


def test_the_vendor_comes_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert cpu_vendor(cpuinfo) == "AuthenticAMD"
    cpuinfo.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")  # an Arm machine
    assert cpu_vendor(cpuinfo) is None
    assert cpu_vendor(tmp_path / "missing") is None
