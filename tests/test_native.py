"""The compiled modules (mate.native): compiled when built so, the pure-Python
path on request, and never a compiled module older than its source."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mate import buffers, native

PACKAGE = Path(native.__file__).parent
BUILT = (PACKAGE / native.RECORD).exists()
needs_build = pytest.mark.skipif(not BUILT, reason="a pure-Python install (nothing compiled)")

PROBE = """
import mate
from mate import native
print(",".join(native.compiled()))
"""


def _probe(env_extra: dict[str, str], path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != native.PURE_VARIABLE}
    env.update(env_extra)
    if path is not None:
        env["PYTHONPATH"] = str(path)
    return subprocess.run([sys.executable, "-W", "always", "-c", PROBE], env=env,
                          capture_output=True, text=True, timeout=60, cwd=path or None)


ALL = [*native.COMPILED, *native.EXTENSIONS]


def test_record_names_each_compiled_source() -> None:
    record = native.record(PACKAGE)
    assert sorted(record) == sorted(ALL)
    assert native.source_of("mate._buffer", PACKAGE).name == "_buffer.c"
    assert native.changed(record, PACKAGE) == []


def test_changed_finds_an_edited_or_missing_source(tmp_path: Path) -> None:
    package = tmp_path / "mate"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    record = native.record(package)
    wire = native.source_of("mate.transports.ibverbs.wire", package)
    wire.write_text(wire.read_text() + "\n# edited\n")
    native.source_of("mate.entry", package).unlink()
    assert native.changed(record, package) == ["mate.entry", "mate.transports.ibverbs.wire"]


@needs_build
def test_every_listed_module_runs_compiled() -> None:
    if os.environ.get(native.PURE_VARIABLE):
        pytest.skip(f"{native.PURE_VARIABLE} is set")
    assert native.compiled() == ALL


def test_pure_python_on_request() -> None:
    run = _probe({native.PURE_VARIABLE: "1"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ""  # nothing compiled
    assert "RuntimeWarning" not in run.stderr


@needs_build
def test_an_edited_source_runs_every_compiled_module_from_source(tmp_path: Path) -> None:
    # A copy of the installed tree (extension modules, the group library and the
    # record included), then an edit, as in an editable install.
    shutil.copytree(PACKAGE, tmp_path / "mate", ignore=shutil.ignore_patterns("__pycache__"))
    for group in PACKAGE.parent.glob("mate__mypyc*"):
        shutil.copy2(group, tmp_path)
    fresh = _probe({}, tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.strip().split(",") == ALL

    wire = tmp_path / "mate" / "transports" / "ibverbs" / "wire.py"
    wire.write_text(wire.read_text() + "\n# edited after the build\n")
    stale = _probe({}, tmp_path)
    assert stale.returncode == 0, stale.stderr
    assert stale.stdout.strip() == ""  # all of them from source (C module left out), not a mix
    assert "mate.transports.ibverbs.wire changed since it was compiled" in stale.stderr

    recorded = json.loads((tmp_path / "mate" / native.RECORD).read_text())
    assert recorded["mate.transports.ibverbs.wire"] != native.digest(wire)



def _expected_address(obj: bytes | bytearray, offset: int) -> int:
    """The address of `obj[offset]`, found by ctypes without mate."""
    if isinstance(obj, bytes):
        base = ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value
    else:
        base = ctypes.addressof(ctypes.c_char.from_buffer(obj))
    assert base is not None
    return base + offset


@pytest.mark.parametrize("kind", [bytearray, bytes])
@pytest.mark.parametrize("offset", [0, 3])
def test_buffer_address_of_both_ways(kind: type, offset: int) -> None:
    """The compiled `mate._buffer` (when it runs) and the ctypes fallback agree, on
    writable and read-only views, at an offset into the exporter too."""
    obj = kind(b"0123456789")
    view = memoryview(obj)[offset:]
    expected = _expected_address(obj, offset)
    assert buffers._address_of(view) == expected
    assert buffers.address_of(view) == expected
