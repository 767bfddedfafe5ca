"""Native CPU kernels: C sources in `ops/csrc/`, compiled on first use and loaded with ctypes.

Why a compiler at run time rather than a wheel with binaries: a kernel is a short file of plain C,
built in well under a second for the CPU it runs on (`-march=native`), and a machine without a C
compiler simply runs the torch path (same results within fp32 rounding; a warning says so once).
Built libraries are cached under `RAINCHECK_NATIVE_CACHE` (default `~/.cache/raincheck/native`, or the
temporary folder where that is not writable), keyed by the source, the flags, the compiler and the CPU,
so an image built elsewhere never loads code compiled for another CPU. `RAINCHECK_NATIVE=0` turns the
kernels off (the torch path everywhere). This module only builds and loads them; their Python sides are
ops/paged_attention.py and ops/gdn_kernel.py, and which a step runs is chosen in ops/backend.py.

ctypes releases the GIL for the call: concurrent engines' steps run their kernels in parallel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
# fast-math in part only: reassociation lets the dot products and sums vectorize; nothing may assume
# finite values (no -ffinite-math-only): the running max starts at -inf, and a NaN must stay a NaN
FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros",
         "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"]

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    return os.environ.get("RAINCHECK_NATIVE", "1") != "0"


def _cache_dirs() -> list[Path]:
    """Where a build may go, in order: the configured folder, else the user's cache, else the temporary
    folder (a container with a read-only root file system and a writable /tmp)."""
    if "RAINCHECK_NATIVE_CACHE" in os.environ:
        return [Path(os.environ["RAINCHECK_NATIVE_CACHE"])]
    user = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "raincheck" / "native"
    return [user, Path(tempfile.gettempdir()) / f"raincheck-native-{os.getuid()}"]


def _cpu_signature() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(dict.fromkeys(keep))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _build(name: str, text: str | None = None) -> ctypes.CDLL | None:
    """`csrc/<name>.c` compiled, or `text` in its place (with csrc/'s headers)."""
    cc = _compiler()
    if cc is None:
        log.warning("native kernel %s: no C compiler found; using the torch path", name)
        return None
    text = (SOURCE_DIR / f"{name}.c").read_text() if text is None else text
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    headers = [h.read_text() for h in sorted(SOURCE_DIR.glob("*.h"))]
    key = hashlib.sha256("\0".join([text, *headers, *FLAGS, version, _cpu_signature()]).encode()).hexdigest()
    errors = []
    for folder in _cache_dirs():
        target = folder / f"{name}-{key[:16]}.so"
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            _check_private(folder)
            if not target.exists():
                # build beside the target and rename: a concurrent process never loads a half-written file
                with tempfile.TemporaryDirectory(dir=folder) as tmp:
                    out, source = Path(tmp) / target.name, Path(tmp) / f"{name}.c"
                    source.write_text(text)
                    done = subprocess.run([cc, *FLAGS, "-I", str(SOURCE_DIR), "-o", str(out), str(source), "-lm"],
                                          capture_output=True, text=True, check=False)
                    if done.returncode != 0:
                        log.warning("native kernel %s failed to compile; using the torch path:\n%s", name,
                                    done.stderr[-2000:])
                        return None
                    os.replace(out, target)
            _check_private(target)
            return ctypes.CDLL(str(target))
        except OSError as e:     # unwritable, not ours, or a library that does not load: the next folder
            errors.append(f"{folder}: {e}")
    log.warning("native kernel %s: nowhere to build it (%s); using the torch path", name, "; ".join(errors))
    return None


def _check_private(path: Path) -> None:
    """Code is loaded only from files and folders this user owns and nobody else may write (the
    temporary folder's name is predictable: another user could plant a library there first). A folder
    or file of ours that others may write (a umask of 002) loses that permission first."""
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to user {st.st_uid}, not to this one")
    if st.st_mode & 0o022:
        os.chmod(path, st.st_mode & 0o7755)


_PTR = ctypes.c_void_p
_I64 = ctypes.c_int64
# each kernel's entry point and argument types: ctypes converts plain ints (data pointers, sizes) itself,
# which costs far less per call than wrapping each argument in Python
_ENTRY = {
    "paged_attention": {"paged_attention_f32": ([_PTR] * 9 + [_I64] * 4 + [ctypes.c_float], ctypes.c_int)},
    "gated_deltanet": {
        "gated_deltanet_f32": ([_PTR], ctypes.c_int),       # its arguments' struct (ops/gdn_kernel.py GDNArgs)
        "fold_maps_f32": ([_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64], None),
    },
    "row_linear": {
        "row_linear_pack_f32": ([_PTR, _PTR, _I64, _I64], None),
        "row_linear_f32": ([_PTR] * 4 + [_I64] * 5, None),
        "row_linear_max_rows": ([], _I64),
        "row_linear_tile": ([], _I64),
    },
}


def _typed(name: str, lib: ctypes.CDLL | None, strict: bool = True) -> ctypes.CDLL | None:
    """`lib` with its entry points' argument types set; not `strict`: an entry point it lacks is left out (a
    build of an earlier revision, which exported fewer)."""
    if lib is not None:
        for entry, (argtypes, restype) in _ENTRY[name].items():
            if not strict and not hasattr(lib, entry):
                continue
            getattr(lib, entry).argtypes = argtypes
            getattr(lib, entry).restype = restype
    return lib


def library(name: str) -> ctypes.CDLL | None:
    """The compiled `csrc/<name>.c`, or None when native kernels are off or cannot be built."""
    if not enabled():
        return None
    with _lock:
        if name not in _libs:
            _libs[name] = _typed(name, _build(name))
        return _libs[name]


def build_variant(name: str, text: str) -> ctypes.CDLL | None:
    """Kernel `name` built from `text` in place of csrc/<name>.c (another revision's, say), cached as the
    file's builds are; None where it cannot be built. For comparing two builds (bench/kernel_ab.py); an entry
    point that `text` lacks is missing from the build too."""
    return _typed(name, _build(name, text), strict=False)


def use(name: str, lib: ctypes.CDLL) -> None:
    """Make `lib` (from `library` or `build_variant`) the build that the layers' calls of kernel `name`
    run from now on, in this process. Only between steps: a step may call a kernel from several threads."""
    with _lock:
        _libs[name] = lib


def loaded(name: str) -> ctypes.CDLL | None:
    """`library(name)` without the settings check once it is loaded: a step picks its ops once
    (ops/backend.py `select`), and its layers' calls then only need the handle."""
    lib = _libs.get(name)
    return lib if lib is not None else library(name)


# whether a kernel is built and takes these tensors (fp32 on the CPU); which ops a step runs is
# ops/backend.py's `select` to decide
def paged_attention_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32 and library("paged_attention") is not None


def gated_deltanet_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32 and library("gated_deltanet") is not None
