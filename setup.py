"""mate's build: pyproject.toml holds the metadata; this adds the compiled modules.

The modules of `mate.native.COMPILED` (the per-message path) are compiled to
C with mypyc, those of `mate.native.EXTENSIONS` are built from their C source,
and the SHA-256 of each source compiled is recorded beside them
(`mate.native` loads the sources instead if one changes later). Pure Python
is installed instead when ``MATE_COMPILE=0``, or when there is no C compiler,
with a note saying so; every module works either way. `mate._mpi` also needs
MPICH's mpi.h and mpi4py's C API, which the build's requirements bring on
Linux (pyproject.toml); where they are missing it is left out, with a note,
and the MPI transport calls mpi4py instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SRC = ROOT / "src"


def _load_native():  # mate.native alone: importing the package would need the build
    spec = importlib.util.spec_from_file_location("_mate_native", SRC / "mate" / "native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NATIVE = _load_native()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(cc.split()[0])


class BuildPy(build_py):
    """An editable install starts from a source tree with nothing compiled in it, so
    that no module compiled by an earlier build (or no longer compiled) lingers."""

    def run(self) -> None:
        if getattr(self, "editable_mode", False):
            for old in [*SRC.glob("mate/**/*.so"), *SRC.glob("mate__mypyc*"),
                        SRC / "mate" / NATIVE.RECORD]:
                old.unlink(missing_ok=True)
        super().run()


class BuildExt(build_ext):
    """build_ext, then the record of what was compiled, beside the package's modules."""

    def run(self) -> None:
        super().run()
        if not self.extensions:
            return
        package = Path(self.get_ext_fullpath("mate.native")).parent  # where they were built
        (package / NATIVE.RECORD).write_text(
            json.dumps(NATIVE.record(SRC / "mate"), indent=1, sort_keys=True) + "\n")


def _mpi_headers() -> list[str] | None:
    """The include directories of MPICH's mpi.h and mpi4py's C API, if both are here."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        import mpi4py

        mpich = distribution("mpich")
    except (ImportError, PackageNotFoundError):
        return None
    headers = [f for f in mpich.files or () if f.name == "mpi.h"]
    if not headers:
        return None
    return [str(Path(mpich.locate_file(headers[0])).resolve().parent), mpi4py.get_include()]


def _c_module(module: str) -> Extension | None:
    source = str(NATIVE.source_of(module, Path("src/mate")))
    if module != "mate._mpi":
        return Extension(module, [source])
    include_dirs = _mpi_headers()
    if include_dirs is None:
        print("mate: no MPICH mpi.h or mpi4py headers at build time: mate._mpi left out "
              "(the MPI transport calls mpi4py)", file=sys.stderr)
        return None
    return Extension(module, [source], include_dirs=include_dirs, libraries=["dl"])


def extensions() -> list:
    if os.environ.get("MATE_COMPILE", "1") == "0":
        print("mate: MATE_COMPILE=0: installing pure Python", file=sys.stderr)
        return []
    if _compiler() is None:
        print("mate: no C compiler found: installing pure Python", file=sys.stderr)
        return []
    from mypyc.build import mypycify

    paths = [str(NATIVE.source_of(m, Path("src/mate"))) for m in NATIVE.COMPILED]
    c_modules = [c for m in NATIVE.EXTENSIONS if (c := _c_module(m)) is not None]
    return [*mypycify(paths, opt_level="3", group_name="mate"), *c_modules]


setup(ext_modules=extensions(), cmdclass={"build_py": BuildPy, "build_ext": BuildExt})
