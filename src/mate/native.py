"""Which of mate's modules run compiled, and the guard that keeps a stale one out.

The per-message path -- the API's argument checks, the core's ledger,
message, matching, deadlines, handler dispatch and loop entry, the transport
contract, the ibverbs transport's engine, wire format, soft device,
transport, progress and pin cache, and the MPI transport's transport,
progress engine and reporter -- is compiled to C with mypyc when mate is
installed (setup.py; ``MATE_COMPILE=0`` installs pure Python, as does a build
with no C compiler). The code is the
same: each compiled module is its own source, type-checked by mypy --strict,
and runs as Python wherever it is not compiled. Four modules are written in C:
`mate._buffer`, for what Python has no cheap call for (a buffer's address,
copies by address: `mate.buffers`), `mate._receipt`, which builds a
receipt by storing its fields into its slots, `mate._stand_back`, the MPI
progress thread's wait while the loop runs the passes, which reads the loop's
clock without the GIL, and `mate._mpi`, the MPI calls every message makes
(`mate.transports.mpi.calls`); where they are not built or not wanted, ctypes,
attrs' constructor, a Python loop over select() and mpi4py serve instead.
`mate.world`, the API in front of the ledger, stays Python: compiled, its
public calls would refuse arguments of the wrong type with a TypeError at the
call boundary, before `mate.arguments` can answer InvalidArgument, and its
reads of a `Transport`'s class attributes would miss a Python subclass's
overrides.

The build records each compiled source's SHA-256 in ``_native.json`` beside
this file. Importing this module (``mate/__init__`` does it first) puts a
finder in front of the import system that loads every compiled module from
its source instead:

* when ``MATE_PURE_PYTHON`` is set (to run or test the pure-Python path), or
* when a source no longer matches what was compiled (an editable install
  after an edit), with a warning naming the changed files;

and the C module is then not imported at all.

It is all or nothing: compiled modules call each other directly, so a mix of
compiled and source versions of one group would hold two copies of a class.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

#: The modules setup.py compiles (import names). Their attributes avoid the names
#: `_thread` and `_inline`, which mypyc 2.4 emits as C keywords.
COMPILED = (
    "mate.arguments",
    "mate.deadlines",
    "mate.dispatch",
    "mate.entry",
    "mate.ledger",
    "mate.matching",
    "mate.message",
    "mate.transports.base",
    "mate.transports.ibverbs.engine",
    "mate.transports.ibverbs.pincache",
    "mate.transports.ibverbs.progress",
    "mate.transports.ibverbs.soft",
    "mate.transports.ibverbs.transport",
    "mate.transports.ibverbs.wire",
    "mate.transports.mpi.progress",
    "mate.transports.mpi.reports",
    "mate.transports.mpi.transport",
)
#: Modules written in C (setup.py builds them beside the others); each is imported
#: with a Python fallback.
EXTENSIONS = ("mate._buffer", "mate._mpi", "mate._receipt", "mate._stand_back")
RECORD = "_native.json"  # beside this file: {module: sha256 of the source compiled}
PURE_VARIABLE = "MATE_PURE_PYTHON"

_PACKAGE = Path(__file__).resolve().parent


def source_of(module: str, package: Path = _PACKAGE) -> Path:
    """The source file of `module` (in `COMPILED` or `EXTENSIONS`) under the package `mate`."""
    suffix = ".c" if module in EXTENSIONS else ".py"
    return package.joinpath(*module.split(".")[1:]).with_suffix(suffix)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(package: Path) -> dict[str, str]:
    """The hashes the build records for the sources under `package` (setup.py)."""
    return {module: digest(source_of(module, package)) for module in (*COMPILED, *EXTENSIONS)}


def changed(recorded: Mapping[str, str], package: Path = _PACKAGE) -> list[str]:
    """The compiled modules whose source differs from the one compiled."""
    out = []
    for module, sha in recorded.items():
        source = source_of(module, package)
        if not source.exists() or digest(source) != sha:
            out.append(module)
    return out


def _recorded(package: Path = _PACKAGE) -> dict[str, str]:
    try:
        data = json.loads((package / RECORD).read_text())
    except (OSError, ValueError):
        return {}  # not compiled (pure install, or no compiler at build time)
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules' sources ahead of their extension modules, and
    keeps the C modules out (their importers fall back to Python)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in EXTENSIONS:
            raise ModuleNotFoundError(f"{fullname}: mate runs pure Python", name=fullname)
        if fullname not in COMPILED:
            return None
        source = source_of(fullname)
        return importlib.util.spec_from_file_location(fullname, source)


def _install() -> None:
    """Load sources instead of compiled modules if asked to or if any is stale."""
    recorded = _recorded()
    if os.environ.get(PURE_VARIABLE):
        reason = None
    elif recorded and (stale := changed(recorded)):
        reason = (f"mate: {', '.join(stale)} changed since it was compiled: running every "
                  f"compiled module from its source (reinstall to compile again)")
    else:
        return
    if any(module in sys.modules for module in (*COMPILED, *EXTENSIONS)):
        return  # too late to switch (mate was imported before this ran)
    sys.meta_path.insert(0, _SourceFinder())
    if reason is not None:
        warnings.warn(reason, RuntimeWarning, stacklevel=2)


_install()


def compiled() -> list[str]:
    """The modules of `COMPILED` and `EXTENSIONS` that run compiled in this process
    (importing them)."""
    running = [name for name in COMPILED
               if not str(importlib.import_module(name).__file__).endswith(".py")]
    for name in EXTENSIONS:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        running.append(name)
    return running
