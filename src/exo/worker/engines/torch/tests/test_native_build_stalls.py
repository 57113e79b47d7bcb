"""Building native kernels on a busy machine (`native_build`), through torch's real builder
and `ninja` with a fake compiler (`CXX`): a script that records each call and sleeps, or
hangs, before writing its output (the link step makes a real, empty shared library, which
torch's builder loads).

A slow build that keeps making progress runs to its end; a stalled one is stopped with its
compilers, leaves no library in the cache and resumes later with the objects it had built;
a builder whose starting process is killed stops its compilers too.

The first test takes two stall limits (marked slow), the others about one. The stall
limit follows the machine's load: `calibrated_stall_s` times the whole pipeline
(a child Python importing torch's builder, `ninja`, the link) with instant compiles and
allows three times that, at least 5 s; no test asserts a duration.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from exo.worker.engines.torch.quant import native_build

FAKE_COMPILER = """\
#!{python}
import os, subprocess, sys, time
arguments = sys.argv[1:]
if "-dumpversion" in arguments or "-dumpfullversion" in arguments:
    print("12.2.0")
    sys.exit(0)
output = arguments[arguments.index("-o") + 1]
with open(os.environ["FAKE_CXX_LOG"], "a") as log:
    log.write(f"{{os.getpid()}} {{os.path.basename(output)}}\\n")
fail = os.environ.get("FAKE_CXX_FAIL", "")
if fail and fail in os.path.basename(output):
    print(f"{{fail}}.cpp:1:1: error: the fake compiler refuses it", file=sys.stderr)
    sys.exit(1)
hang = os.environ.get("FAKE_CXX_HANG", "")
if hang and hang in os.path.basename(output):
    time.sleep(3600)
time.sleep(float(os.environ.get("FAKE_CXX_SECONDS", "0")))
if output.endswith(".so"):
    subprocess.run(["{cc}", "-shared", "-x", "c", "/dev/null", "-o", output], check=True)
else:
    with open(output, "wb") as built:
        built.write(b"object")
if "-MF" in arguments:
    with open(arguments[arguments.index("-MF") + 1], "w") as depfile:
        depfile.write(f"{{output}}:\\n")
"""
SOURCES = ("first.cpp", "second.cpp", "third.cpp")


class FakeCompiler:
    """The fake `CXX` and what it was asked to build."""

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        compiler = shutil.which("gcc") or shutil.which("cc")
        if compiler is None:
            pytest.skip("no C compiler to link the fake library")
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "g++"  # torch accepts a compiler named like GCC's
        self.path.write_text(FAKE_COMPILER.format(python=sys.executable, cc=compiler))
        self.path.chmod(0o755)
        self.log = directory / "calls.log"
        self.log.touch()
        monkeypatch.setenv("CXX", str(self.path))
        monkeypatch.setenv("FAKE_CXX_LOG", str(self.log))
        monkeypatch.setenv("MAX_JOBS", "1")  # one compile at a time: gaps as planned

    def calls(self) -> list[tuple[int, str]]:
        """(pid, output file name) of every call, in order."""
        lines = self.log.read_text().splitlines()
        return [(int(pid), output) for pid, output in (line.split() for line in lines)]


def sources(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / name for name in SOURCES]
    for path in paths:
        path.write_text("// never compiled: the fake compiler only records the call\n")
    return paths


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(condition: object, timeout_s: float, what: str) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def calibrated_stall_s(tmp_path_factory: pytest.TempPathFactory) -> float:
    """Three times a whole build with instant compiles here and now, at least 5 s; the
    build itself must succeed (the plain path: library in place, build directory gone)."""
    root = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as patch:
        FakeCompiler(root / "compiler", patch)
        paths = sources(root / "sources")
        (root / "cache").mkdir()
        started = time.monotonic()
        library = native_build.built_extension("exo_calibration", paths, [], root / "cache")
        elapsed = time.monotonic() - started
    assert library.exists()
    assert not (root / "cache" / "exo_calibration.build").exists()
    return max(5.0, 3 * elapsed)


@pytest.fixture
def stall_s(calibrated_stall_s: float, monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(native_build, "BUILD_STALL_S", calibrated_stall_s)
    monkeypatch.setattr(native_build, "STOP_GRACE_S", 5.0)
    return calibrated_stall_s


@pytest.mark.slow  # two stall limits: ~35 s at load 6-9 on 2 cores
def test_a_build_slower_than_the_stall_limit_that_keeps_making_progress_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stall_s: float
) -> None:
    """Each object takes half the stall limit: the build takes twice the limit in all and
    finishes. A `lock` file torch's builder left in the build directory (its holder killed)
    does not hold it up."""
    compiler = FakeCompiler(tmp_path / "compiler", monkeypatch)
    monkeypatch.setenv("FAKE_CXX_SECONDS", str(stall_s / 2))
    root = tmp_path / "cache"
    (root / "exo_slow.build").mkdir(parents=True)
    (root / "exo_slow.build" / "lock").touch()
    # Three objects and the link at half the limit each: twice the limit in all.
    library = native_build.built_extension("exo_slow", sources(tmp_path / "src"), [], root)
    assert library == root / "exo_slow.so" and library.exists()
    assert [output for _, output in compiler.calls()] == [
        "first.o", "second.o", "third.o", "exo_slow.so",
    ]  # fmt: skip
    assert sorted(path.name for path in root.iterdir()) == ["exo_slow.lock", "exo_slow.so"]


def test_a_stalled_build_stops_its_compiler_leaves_no_library_and_resumes_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stall_s: float
) -> None:
    """The second object's compile hangs: the build is stopped after the stall limit, the
    hanging compiler with it; no library is in the cache, the lock is free. The next build
    compiles only what was not built (the first object is kept)."""
    compiler = FakeCompiler(tmp_path / "compiler", monkeypatch)
    monkeypatch.setenv("FAKE_CXX_HANG", "second")
    root = tmp_path / "cache"
    root.mkdir()
    paths = sources(tmp_path / "src")
    with pytest.raises(native_build.BuildStalled, match="no object built"):
        native_build.built_extension("exo_stall", paths, [], root)
    calls = compiler.calls()
    assert [output for _, output in calls] == ["first.o", "second.o"]
    hung = calls[-1][0]
    wait_until(lambda: not alive(hung), 10.0, "the hanging compiler still runs")
    assert not list(root.glob("*.so"))
    assert (root / "exo_stall.build" / "first.o").exists()
    assert not (root / "exo_stall.build" / "second.o").exists()

    monkeypatch.delenv("FAKE_CXX_HANG")
    library = native_build.built_extension("exo_stall", paths, [], root)
    assert library.exists()
    assert [output for _, output in compiler.calls()[len(calls) :]] == [
        "second.o", "third.o", "exo_stall.so",
    ]  # fmt: skip


def test_a_failed_build_says_the_compilers_error_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler error (at the first object: nothing built to resume) is a RuntimeError
    naming the compiler's error line; no library and no build directory stay."""
    FakeCompiler(tmp_path / "compiler", monkeypatch)
    monkeypatch.setenv("FAKE_CXX_FAIL", "first")
    root = tmp_path / "cache"
    root.mkdir()
    with pytest.raises(RuntimeError, match=r"first\.cpp:1:1: error: the fake compiler") as failed:
        native_build.built_extension("exo_fail", sources(tmp_path / "src"), [], root)
    assert not isinstance(failed.value, native_build.BuildStalled)
    assert sorted(path.name for path in root.iterdir()) == ["exo_fail.lock"]


def test_a_builder_whose_starting_process_is_killed_stops_its_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stall_s: float
) -> None:
    """A runner killed mid-build (SIGKILL: nothing of it runs after): the builder gets the
    parent-death signal and stops ninja, which stops the compiler; the lock is free and
    the next build goes on from what was built."""
    compiler = FakeCompiler(tmp_path / "compiler", monkeypatch)
    monkeypatch.setenv("FAKE_CXX_HANG", "second")
    root = tmp_path / "cache"
    root.mkdir()
    paths = sources(tmp_path / "src")
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from exo.worker.engines.torch.quant import native_build
        native_build.built_extension(
            "exo_orphan", [Path(p) for p in {[str(path) for path in paths]!r}], [],
            Path({str(root)!r}),
        )
        """
    )
    runner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(compiler.calls()) == 2, 6 * stall_s, "no hanging compile")
        runner.kill()
        runner.wait(timeout=10)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=10)
    hung = compiler.calls()[-1][0]
    wait_until(lambda: not alive(hung), 15.0, "the killed runner's compiler still runs")
    assert not list(root.glob("*.so"))
    monkeypatch.delenv("FAKE_CXX_HANG")
    assert native_build.built_extension("exo_orphan", paths, [], root).exists()
    assert [output for _, output in compiler.calls()[2:]] == [
        "second.o", "third.o", "exo_orphan.so",
    ]  # fmt: skip


def test_stopping_sends_sigterm_to_the_whole_group_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process group that ignores SIGTERM is killed after the grace period."""
    monkeypatch.setattr(native_build, "STOP_GRACE_S", 1.0)
    stubborn = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "print('ready', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
        native_build._stop(stubborn)
        assert stubborn.returncode == -signal.SIGKILL
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
        stubborn.wait(timeout=10)
        if stubborn.stdout is not None:
            stubborn.stdout.close()
