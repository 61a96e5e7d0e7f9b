"""The C kernels' build (`pagoda.utils.cpu_build`): one compile per library however many
builders ask for it at once, and `prebuild`'s order and number of compilers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pagoda.utils import cpu_build as build

pytestmark = pytest.mark.skipif(not build.compiler_available(), reason="no C compiler")

SOURCE = "int pagoda_test_answer(void) { return 42; }\n"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def sources(tmp_path: Path, n: int) -> list[Path]:
    paths = []
    for i in range(n):
        path = tmp_path / f"lib{i}.c"
        path.write_text(SOURCE.replace("answer", f"answer{i}"))
        paths.append(path)
    return paths


def test_concurrent_builders_compile_a_library_once(tmp_path, cache, monkeypatch):
    compiles = []
    real = build._compile

    def slow_compile(cc, flags, source, out):
        compiles.append(out.name)
        time.sleep(0.3)  # long enough for every thread to find the library missing
        real(cc, flags, source, out)

    monkeypatch.setattr(build, "_compile", slow_compile)
    (source,) = sources(tmp_path, 1)
    paths: list[Path] = []
    threads = [
        threading.Thread(target=lambda: paths.append(build.build_library(source, (), "portable")))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiles) == 1 and len(set(paths)) == 1 and paths[0].exists()


def test_prebuild_takes_the_libraries_in_order_a_compiler_per_core(tmp_path, cache, monkeypatch):
    started, running, most = [], [0], [0]
    lock = threading.Lock()
    real = build._compile

    def counted(cc, flags, source, out):
        with lock:
            started.append(source.name)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        real(cc, flags, source, out)
        with lock:
            running[0] -= 1

    monkeypatch.setattr(build, "_compile", counted)
    monkeypatch.setattr(build, "build_workers", lambda: 2)
    libs = [(path, (), "portable") for path in sources(tmp_path, 5)]
    build.prebuild(libs)
    assert most[0] == 2
    assert set(started[:2]) == {"lib0.c", "lib1.c"}  # the first listed start first
    assert sorted(started) == [p.name for p, _, _ in libs]
    build.prebuild(libs)  # started before: nothing compiles again
    assert len(started) == 5


def test_prebuild_in_the_background_and_the_loader_waits_for_it(tmp_path, cache, monkeypatch):
    compiling, release = threading.Event(), threading.Event()
    real = build._compile

    def held(cc, flags, source, out):
        compiling.set()
        release.wait(10)
        real(cc, flags, source, out)

    monkeypatch.setattr(build, "_compile", held)
    (source,) = sources(tmp_path, 1)
    build.prebuild([(source, (), "portable")], wait=False)  # returns with the build held
    assert compiling.wait(10) and not list(cache.glob("*.so"))
    threading.Timer(0.3, release.set).start()
    monkeypatch.setattr(build, "_compile", lambda *a: pytest.fail("compiled a second time"))
    assert build.build_library(source, (), "portable").exists()  # waited for the first build


def test_a_cpu_engine_config_starts_the_kernel_build(monkeypatch):
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.utils import cpu_kernels

    started = []
    monkeypatch.setattr(cpu_kernels, "start_build", started.append)
    EngineArgs(device="cpu", max_model_len=256).create_engine_config()
    assert started == [True]  # the embedded model is a GGUF file: the quantized GEMM too
    assert cpu_kernels.engine_libraries(True)[0] == cpu_kernels.QUANT  # the longest first


def test_auto_device_is_the_cpu_without_a_gpu_driver(monkeypatch):
    from pagoda.utils import cpu_kernels

    monkeypatch.setattr(cpu_kernels.os.path, "exists", lambda path: False)
    assert cpu_kernels.runs_on_cpu("auto") and cpu_kernels.runs_on_cpu("cpu")
    assert not cpu_kernels.runs_on_cpu("cuda")
    monkeypatch.setattr(cpu_kernels.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    assert not cpu_kernels.runs_on_cpu("auto")
