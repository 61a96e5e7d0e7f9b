"""Build and load the C paged-attention kernel (`paged_attention.c`) at first use.

`build_library` is the shared helper (the CPU GEMV / element-wise ops in `pagoda.kernels.cpu`
build through it too): a source is compiled with the system C compiler (`$CC`, else `cc`, else `gcc`) for this CPU
(`-O3 -march=native`, or `-march=$PAGODA_CPU_ARCH`; OpenMP when the compiler has it) into a cache directory
(`$PAGODA_CACHE_DIR`, else `~/.cache/pagoda`), under a name keyed by a hash of the source, the
flags, the compiler and the CPU's feature flags, so a changed source or a different machine
builds afresh and everything else loads the cached library. Concurrent builders (test workers,
several engines) each compile to a private temporary file and `os.replace` it into place, which
is atomic: a reader sees either no library or a whole one. Any failure raises
`CpuKernelUnavailable` with the reason, so the caller can fall back to the torch backend.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

SOURCE = Path(__file__).with_name("paged_attention.c")
HEADERS = ("vec.h", "tile.h")  # included by SOURCE: part of the cache key
_ABI = 1  # pagoda_paged_attention_abi() of the source this loader can call
_BASE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-Wno-psabi"]


class CpuKernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here (no compiler, build error, ...)."""


def cache_dir() -> Path:
    root = os.environ.get("PAGODA_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pagoda"


def _find_compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and (path := shutil.which(name)):
            return path
    raise CpuKernelUnavailable("no C compiler found (set $CC or install gcc)")


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compile(cc: str, flags: list[str], source: Path, out: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, str(source), "-o", tmp, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise CpuKernelUnavailable(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: racing builders write identical files
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(cc: str, flags: list[str], source: Path, headers: Sequence[str]) -> Path:
    text = b"".join(source.with_name(f).read_bytes() for f in (source.name, *headers))
    key = hashlib.sha256(
        b"\0".join([text, " ".join(flags).encode(), cc.encode(), cpu_flags().encode()])
    ).hexdigest()[:16]
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CpuKernelUnavailable(f"cache dir {directory} not writable ({e})") from e
    lib = directory / f"{source.stem}_{key}.so"
    if not lib.exists():
        _compile(cc, flags, source, lib)
    return lib


def build_library(source: Path, headers: Sequence[str] = ()) -> Path:
    """Compile `source` (and the `headers` beside it that it includes) for this CPU into the
    cache, or find it there; the path of the shared library.

    Raises CpuKernelUnavailable when a file is missing, there is no compiler or the build
    fails; a compiler without OpenMP (e.g. Apple clang) gets a single-threaded build instead."""
    missing = [f for f in (source.name, *headers) if not source.with_name(f).exists()]
    if missing:
        raise CpuKernelUnavailable(f"{missing} missing from {source.parent} in this install")
    cc = _find_compiler()
    # $PAGODA_CPU_ARCH (e.g. x86-64-v3) builds for a baseline instead of this CPU (tests, images).
    flags = [*_BASE_FLAGS, f"-march={os.environ.get('PAGODA_CPU_ARCH') or 'native'}"]
    try:
        return _build(cc, [*flags, "-fopenmp"], source, headers)
    except CpuKernelUnavailable:
        return _build(cc, flags, source, headers)


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled kernel, built on first call (~2 s) and cached on disk afterwards.

    Raises CpuKernelUnavailable when there is no compiler or the build or load fails (see
    `build_library`)."""
    lib_path = build_library(SOURCE, HEADERS)
    # torch is imported first, so an OpenMP build links the libgomp torch already loaded and the
    # kernel shares torch's worker threads instead of spinning up a second pool.
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError as e:
        raise CpuKernelUnavailable(f"loading {lib_path} failed ({e})") from e
    if lib.pagoda_paged_attention_abi() != _ABI:
        raise CpuKernelUnavailable(f"{lib_path} is not the library this loader expects")
    fn = lib.pagoda_paged_attention
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32]
    fn.argtypes += [i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = ctypes.c_int
    return lib
