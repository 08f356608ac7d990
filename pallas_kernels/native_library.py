"""Finding and checking a native kernel library that setup.py built at install time (one per
kernel source in pallas_kernels/native/): where it is, whether it loads, and whether it was
built from the source beside it. A library built from another source is refused, never run;
the refusal says how to rebuild. Shared by the native attention and matmul loaders, each of
which caches its own `_load` (tests point a loader at another source and clear that cache).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
from pathlib import Path

class NativeBuildError(RuntimeError):
    """A native kernel could not be loaded; the message says why and what to use instead."""


REBUILD = "rebuild it with `make setup` (pip install -e .) or `python setup.py build_ext --inplace`"


def source_hash(source: Path) -> str:
    """sha256 of a kernel source, 16 hex digits: what setup.py builds into its library."""
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


def library_path(source: Path, library: str) -> Path | None:
    """The library `library` built beside `source`, or None where the install did not build it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = source.parent / (library + suffix)
        if path.exists():
            return path
    return None


def load(source: Path, library: str, what: str, missing_hint: str = "") -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded library, None), or (None, why not): not built, not loading, or built from
    another source. `what` names the kernel in the message ("attention", "matmul")."""
    path = library_path(source, library)
    if path is None:
        return None, (f"the native CPU {what} kernel was not built at install time (no {library}*.so "
                      f"beside {source.name}{missing_hint}); {REBUILD}")
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        built_from = ctypes.CFUNCTYPE(ctypes.c_char_p)(("JaxserveNativeSourceHash", lib))().decode()
    except (OSError, AttributeError) as e:
        return None, f"the native CPU {what} kernel {path.name} does not load ({e}); {REBUILD}"
    if built_from != source_hash(source):
        return None, (f"the native CPU {what} kernel {path.name} was built from another {source.name} "
                      f"(hash {built_from}, the source's is {source_hash(source)}); {REBUILD}")
    return lib, None
