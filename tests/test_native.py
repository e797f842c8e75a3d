"""The compiled modules (mate.native): compiled when built so, the pure-Python
path on request, and never a compiled module older than its source."""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import pytest

from mate import FailureReason, MessageFailed, buffers, message, native
from mate.schedule import Event, Op, Receipt

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


def _c_module(name: str) -> ModuleType | None:
    """The C module `name` (`native.EXTENSIONS`), or None where it does not run."""
    try:
        return importlib.import_module(name)
    except ImportError:  # a pure-Python install, or MATE_PURE_PYTHON
        return None


_BUFFER = _c_module("mate._buffer")
MEMMOVES = [buffers._memmove, *([_BUFFER.memmove] if _BUFFER else [])]
STRING_ATS = [ctypes.string_at, *([_BUFFER.string_at] if _BUFFER else [])]


@pytest.mark.parametrize("memmove", MEMMOVES)
@pytest.mark.parametrize("size", [0, 1, 10, 64 * 1024 + 3])  # the last copies without the GIL
def test_memmove_copies_between_addresses(memmove: Any, size: int) -> None:
    src = bytearray(os.urandom(size + 8))
    dst = bytearray(size + 8)
    base = buffers.address_of(memoryview(dst))
    memmove(base + 4, buffers.address_of(memoryview(src)) + 2, size)
    assert dst == bytes(4) + src[2:2 + size] + bytes(4)  # nothing written around the run


@pytest.mark.parametrize("memmove", MEMMOVES)
def test_memmove_allows_overlapping_runs(memmove: Any) -> None:
    data = bytearray(b"0123456789")
    base = buffers.address_of(memoryview(data))
    memmove(base + 2, base, 6)
    assert data == b"0101234589"
    memmove(base, base + 3, 7)
    assert data == b"1234589589"


@pytest.mark.parametrize("string_at", STRING_ATS)
def test_string_at_reads_the_bytes_at_an_address(string_at: Any) -> None:
    data = bytes(range(256)) * 300
    base = buffers.address_of(memoryview(data))
    assert string_at(base + 5, 1000) == data[5:1005]
    assert string_at(base, 0) == b""
    assert isinstance(string_at(base, 3), bytes)


@pytest.mark.skipif(_BUFFER is None, reason="mate._buffer is not built or not wanted")
def test_buffer_copies_refuse_bad_arguments() -> None:
    assert _BUFFER is not None
    data = bytearray(8)
    base = buffers.address_of(memoryview(data))
    with pytest.raises(ValueError, match="negative"):
        _BUFFER.memmove(base, base, -1)
    with pytest.raises(ValueError, match="negative"):
        _BUFFER.string_at(base, -2)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        _BUFFER.memmove(base, base)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        _BUFFER.string_at(base)
    with pytest.raises(TypeError):
        _BUFFER.string_at("not an address", 1)
    assert data == bytes(8)


_RECEIPT = _c_module("mate._receipt")
FIELDS = [
    (Op.SEND, 3, 8, 0, 1, 4096, None, Event.COMPLETION, None),
    (Op.GET, None, 0, 2, 1, 8192, 64, Event.FAILURE, MessageFailed(FailureReason.TRANSPORT, "x")),
    (Op.RECV, 7, 5, 1, 0, 1, None, None, None),
]


@pytest.mark.parametrize("fields", FIELDS)
def test_the_receipts_mate_builds_are_attrs_receipts(fields: tuple[Any, ...]) -> None:
    """`mate.message` builds receipts with `mate._receipt` where it runs: the same
    value, by every measure attrs gives, as Receipt's own constructor."""
    expected = Receipt(*fields)
    built = message._build_receipt(*fields)
    assert type(built) is Receipt
    assert built == expected and hash(built) == hash(expected) and repr(built) == repr(expected)
    assert attrs.astuple(built, recurse=False) == fields
    assert attrs.evolve(built, length=99) == attrs.evolve(expected, length=99)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        built.length = 1  # type: ignore[misc]
    del built  # the slots' references go with it
    assert all(sys.getrefcount(value) > 1 for value in fields)


@pytest.mark.skipif(_RECEIPT is None, reason="mate._receipt is not built or not wanted")
def test_receipt_builder_refuses_bad_arguments() -> None:
    assert _RECEIPT is not None
    assert message._build_receipt is _RECEIPT.build
    with pytest.raises(TypeError, match="takes 9 arguments"):
        _RECEIPT.build(Op.SEND)
    # bind() checks everything before it changes anything: receipts still build.
    with pytest.raises(ValueError, match="not a writable slot"):
        _RECEIPT.bind(Receipt, ("op", "__repr__"))
    with pytest.raises(AttributeError):
        _RECEIPT.bind(Receipt, ("op", "no_such_field"))
    with pytest.raises(TypeError):
        _RECEIPT.bind(Receipt, ["op"])
    assert message._build_receipt(*FIELDS[0]) == Receipt(*FIELDS[0])
