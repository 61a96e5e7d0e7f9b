"""Build and load Pagoda's C CPU kernels at first use, one build per ISA level.

`build_library` is the one build helper (the paged-attention kernel of `pagoda.attention.cpu`,
the element-wise ops and GEMMs of `pagoda.kernels.cpu` and its quantized GEMM build through
it): a source is compiled with the system C compiler (`$CC`, else `cc`, else `gcc`; `-O3`,
OpenMP when the compiler has it) for one ISA level, named by explicit `-m` flags rather than
`-march=native`:

    portable     the compiler's baseline (SSE2 on x86-64, NEON on AArch64), any CPU
    avx2         -mavx2 -mfma -mf16c -mbmi2
    avx512       + AVX-512 F/BW/VL/DQ (+ VNNI where the CPU has it)
    avx512_bf16  + AVX512_BF16 (vdpbf16ps)

`selected_isa()` is the highest level the CPU's feature flags (/proc/cpuinfo) allow, or the one
`$PAGODA_CPU_ISA` forces (a level the CPU lacks is a ValueError). The library lands in a cache
directory (`$PAGODA_CACHE_DIR`, else `~/.cache/pagoda`) under a name keyed by a hash of the
source, the level, the flags, the compiler and the CPU's feature flags, so a changed source,
another level or another machine builds afresh and everything else loads the cached library.
Concurrent builders (threads, test workers, several engines, a server's front end and its
engine core) take a lock file beside the library (`flock`) before compiling it, so one of them
compiles and the others wait for it and load its result; the compiler writes a private
temporary file that `os.replace` moves into place, which is atomic: a reader sees either no
library or a whole one. Any failure raises `CpuKernelUnavailable` with the reason; `build_with_fallback` then
tries the portable level once (one warning), and the callers fall back to torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from pagoda import envs
from pagoda.envs import usable_cores

try:
    import fcntl
except ImportError:  # not POSIX: concurrent builders then compile side by side
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

_BASE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-Wno-psabi"]

ISA_LEVELS = ("portable", "avx2", "avx512", "avx512_bf16")  # lowest first
ISA_ENV = "PAGODA_CPU_ISA"
# /proc/cpuinfo flags each level needs on top of the level below it.
_ISA_CPU_FLAGS = {
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
}
_ISA_CC_FLAGS = {
    "portable": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mbmi2"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512_bf16": ("-mavx512bf16",),
}


AMX_CC_FLAGS = ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]


class CpuKernelUnavailable(RuntimeError):
    """A C kernel could not be built or loaded here (no compiler, build error, ...)."""


def open_library(path: Path, abi_symbol: str, abi: int) -> ctypes.CDLL:
    """The built library at `path`, loaded, once its `abi_symbol()` returns `abi` (the loader
    and the library agree on every entry point's arguments). Raises CpuKernelUnavailable."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise CpuKernelUnavailable(f"loading {path} failed ({e})") from e
    if getattr(lib, abi_symbol)() != abi:
        raise CpuKernelUnavailable(f"{path} is not the library this loader expects")
    return lib


def cache_dir() -> Path:
    return envs.PAGODA_CACHE_DIR


def _find_compiler() -> str:
    for name in (envs.CC, "cc", "gcc"):
        if name and (path := shutil.which(name)):
            return path
    raise CpuKernelUnavailable("no C compiler found (set $CC or install gcc)")


def compiler_available() -> bool:
    """Whether a C compiler is on the path (the kernels may still fail to build)."""
    try:
        _find_compiler()
    except CpuKernelUnavailable:
        return False
    return True


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- ISA levels ---------------------------------------------------------------------------


def cpu_arch() -> str:
    return platform.machine().lower()


def supported_isas(flags: str | None = None, arch: str | None = None) -> tuple[str, ...]:
    """The levels a CPU with these feature flags and architecture (default: this one's) runs,
    lowest first. Only x86-64 has levels above portable; an unknown CPU gets portable alone."""
    have = set((cpu_flags() if flags is None else flags).split())
    if (cpu_arch() if arch is None else arch) not in ("x86_64", "amd64"):
        return ("portable",)
    levels = ["portable"]
    for isa in ISA_LEVELS[1:]:
        if not have.issuperset(_ISA_CPU_FLAGS[isa]):
            break
        levels.append(isa)
    return tuple(levels)


def best_isa() -> str:
    """The highest level this CPU runs."""
    return supported_isas()[-1]


def selected_isa() -> str:
    """The level the CPU kernels build for: `$PAGODA_CPU_ISA` when set, else `best_isa()`.

    Raises ValueError for an unknown level or one this CPU lacks (the message names the
    variable and the CPU's best level)."""
    forced = envs.PAGODA_CPU_ISA
    if not forced:
        return best_isa()
    if forced not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LEVELS)}; got {forced!r}")
    if forced not in supported_isas():
        raise ValueError(
            f"{ISA_ENV}={forced}: this CPU lacks it (its best level is {best_isa()}); "
            f"unset {ISA_ENV} or pick a lower level"
        )
    return forced


def isa_compile_flags(isa: str) -> list[str]:
    """The compiler's -m flags of a level: its own and every lower level's."""
    if isa not in ISA_LEVELS:
        raise ValueError(f"unknown ISA level {isa!r}; expected one of {ISA_LEVELS}")
    flags = [f for level in ISA_LEVELS[: ISA_LEVELS.index(isa) + 1] for f in _ISA_CC_FLAGS[level]]
    have = set(cpu_flags().split())
    if isa in ("avx512", "avx512_bf16") and "avx512_vnni" in have:
        flags.append("-mavx512vnni")  # vpdpbusd, for the quantized GEMM's int8 dot products
    if (
        isa == "avx512_bf16"
        and {"amx_tile", "amx_bf16", "amx_int8"} <= have
        and envs.PAGODA_CPU_AMX
    ):
        flags += AMX_CC_FLAGS  # AMX tiles: the packed GEMM's (gemm_amx.h), the GGUF blocks'
    return flags


def amx_built(isa: str | None = None) -> bool:
    """Whether the kernels built for `isa` (default: the selected level) carry AMX tiles: a CPU
    with AMX, `$PAGODA_CPU_AMX` not 0, the avx512_bf16 level and a compiler that takes the
    flags. They run where the OS grants AMX state too (`os_grants_amx`)."""
    if AMX_CC_FLAGS[0] not in isa_compile_flags(isa or selected_isa()):
        return False
    try:
        return _compiler_takes(_find_compiler(), tuple(AMX_CC_FLAGS))
    except CpuKernelUnavailable:
        return False


def os_grants_amx() -> bool:
    """Whether Linux lets this process use AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM, as the
    kernels ask before their first tile; Linux 5.16 on, x86-64 only)."""
    if platform.system() != "Linux" or cpu_arch() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA


_said: set[str] = set()  # what log_once has logged in this process


def log_once(level: int, message: str) -> None:
    """Logs `message` the first time only: the kernels (attention, ops, quantized GEMM) load
    one after another and would each report the same cause."""
    if message not in _said:
        _said.add(message)
        logger.log(level, message)


def log_isa(isa: str) -> None:
    """The one line saying which level runs (said by the first library loaded)."""
    if "isa" in _said:
        return
    _said.add("isa")
    how = f"forced by {ISA_ENV}" if envs.PAGODA_CPU_ISA else f"set {ISA_ENV} to force one"
    tiles = " with AMX tiles" if amx_built(isa) and os_grants_amx() else ""
    logger.info("CPU kernels: %s%s (this CPU's best level: %s; %s)", isa, tiles, best_isa(), how)


def warn_unavailable(e: Exception) -> None:
    """The one line saying a kernel did not build or load, so its torch code runs."""
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
    log_once(logging.WARNING, f"CPU kernels unavailable ({reason}); using the torch path")


# ---- building -----------------------------------------------------------------------------


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


@functools.cache
def _compiler_takes(cc: str, flags: tuple[str, ...]) -> bool:
    """Whether `cc` compiles an empty file with `flags` (-m flags newer than the compiler)."""
    cmd = [cc, *flags, "-x", "c", "-c", os.devnull, "-o", os.devnull]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@contextlib.contextmanager
def _build_lock(lib: Path) -> Iterator[None]:
    """Held while `lib` is compiled: other threads and processes wait here for it."""
    if fcntl is None:
        yield
        return
    with open(lib.with_name(lib.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def _build(cc: str, flags: list[str], source: Path, headers: Sequence[str], isa: str) -> Path:
    text = b"".join(source.with_name(f).read_bytes() for f in (source.name, *headers))
    parts = [text, isa.encode(), " ".join(flags).encode(), cc.encode(), cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CpuKernelUnavailable(f"cache dir {directory} not writable ({e})") from e
    lib = directory / f"{source.stem}_{isa}_{key}.so"
    if not lib.exists():
        with _build_lock(lib):
            if not lib.exists():  # else another builder made it while this one waited
                _compile(cc, flags, source, lib)
    return lib


def build_library(source: Path, headers: Sequence[str] = (), isa: str | None = None) -> Path:
    """Compile `source` (and the `headers` beside it that it includes) for ISA level `isa`
    (default `selected_isa()`) into the cache, or find it there; the path of the library.

    Raises CpuKernelUnavailable when a file is missing, there is no compiler or the build
    fails; a compiler without OpenMP (e.g. Apple clang) gets a single-threaded build instead."""
    isa = isa or selected_isa()
    missing = [f for f in (source.name, *headers) if not source.with_name(f).exists()]
    if missing:
        raise CpuKernelUnavailable(f"{missing} missing from {source.parent} in this install")
    cc = _find_compiler()
    flags = [*_BASE_FLAGS, *isa_compile_flags(isa)]
    if AMX_CC_FLAGS[0] in flags and not _compiler_takes(cc, tuple(AMX_CC_FLAGS)):
        flags = [f for f in flags if f not in AMX_CC_FLAGS]  # an older compiler: no tiles
    try:
        return _build(cc, [*flags, "-fopenmp"], source, headers, isa)
    except CpuKernelUnavailable:
        return _build(cc, flags, source, headers, isa)


def build_with_fallback(
    source: Path, headers: Sequence[str] = (), isa: str | None = None
) -> tuple[Path, str]:
    """`build_library` at `isa` (default `selected_isa()`); when that fails at a level above
    portable that `$PAGODA_CPU_ISA` did not force (an old compiler without the flags, say), the
    portable build, with one warning. Returns (library, level built); raises
    CpuKernelUnavailable when nothing builds."""
    chosen = isa or selected_isa()
    try:
        return build_library(source, headers, chosen), chosen
    except CpuKernelUnavailable as e:
        if chosen == "portable" or isa is not None or envs.PAGODA_CPU_ISA:
            raise
        reason = (str(e).strip().splitlines() or ["build failed"])[-1][:300]
        log_once(
            logging.WARNING, f"CPU kernels: the {chosen} build failed ({reason}); using portable"
        )
        _said.add("isa")  # that line says which level runs
        return build_library(source, headers, "portable"), "portable"


Library = tuple[Path, Sequence[str], str | None]  # (source, headers, ISA level or None)
# The builds prebuild started in this process, by what decides their library file.
_started: dict[tuple, Future[tuple[Path, str]]] = {}
_started_lock = threading.Lock()


def build_workers() -> int:
    """Compilers run at once: one per core this process may use (more only share them)."""
    return usable_cores()


def prebuild(libraries: Sequence[Library], wait: bool = True) -> None:
    """Build the (source, headers, isa) libraries into the cache, `build_workers()` compilers at
    a time taking them in the order given: listed longest first, a first start on 2 cores
    compiles the longest on one core while the others follow one another on the second, and
    both finish together. Without `wait` it returns at once and the builds go on in the
    background; a loader asking for a library still being compiled waits for it
    (`_build_lock`). A build an earlier call started is not started again. Errors are left to
    the loaders, which say them."""
    if not compiler_available():
        return
    keys = [
        (cache_dir(), src, tuple(hdrs), isa, envs.PAGODA_CPU_ISA) for src, hdrs, isa in libraries
    ]
    with _started_lock:
        new = [(k, lib) for k, lib in zip(keys, libraries) if k not in _started]
        if new:
            pool = ThreadPoolExecutor(max_workers=min(len(new), build_workers()))
            for k, lib in new:
                _started[k] = pool.submit(build_with_fallback, *lib)
            pool.shutdown(wait=False)  # its threads exit once the queue is done
        futures = [_started[k] for k in keys]
    if not wait:
        return
    for f in futures:
        try:
            f.result()
        except CpuKernelUnavailable:
            pass
