"""Run a test module on N real processes under a launcher, and report every rank.

`run_under_mpiexec(module, n, options)` starts ``mpiexec -n N python -m pytest
MODULE`` with the transport and its options in the environment (see
conftest.py); each rank runs the same tests against its own world.
`run_under_mate_run` does the same for the ibverbs transport under
``mate-run -n N --transport ibverbs``. The result holds every rank's output,
so that a failure on any rank is shown whole. `load_script(path)` imports an
example or a bench script that is no package's module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from mate.run import find_mpiexec

TESTS = Path(__file__).parent


def load_script(path: Path) -> ModuleType:
    """Import the script at `path` as the module named after its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # its dataclasses and attrs classes look their module up
    spec.loader.exec_module(module)
    return module


def run_under_mpiexec(module: str, nranks: int, options: dict[str, object],
                      *, timeout: float = 600, extra: tuple[str, ...] = (),
                      loop: str = "asyncio") -> None:
    launcher = [find_mpiexec(), "-n", str(nranks), "-l", sys.executable]
    _run_launched("mpi", launcher, module, nranks, options, timeout, extra, loop)


def run_under_mate_run(module: str, nranks: int, options: dict[str, object],
                       *, timeout: float = 600, extra: tuple[str, ...] = (),
                       loop: str = "asyncio") -> None:
    launcher = [sys.executable, "-m", "mate.run", "-n", str(nranks), "--transport", "ibverbs",
                "python"]
    _run_launched("ibverbs", launcher, module, nranks, options, timeout, extra, loop)


def run_bounded(command: list[str], timeout: float, what: str,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `command` (a launcher, usually) in a session of its own; fail the test if it
    outlives `timeout` seconds, once the whole session is killed: the launcher's ranks
    too, which would otherwise run on (spinning, maybe) through the rest of the suite."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=TESTS.parent, env=env, start_new_session=True) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # mate-run passes a SIGTERM on to mpiexec's ranks; what is left of the
            # session after a grace period (mate-run's own ranks, for ibverbs) is killed.
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):  # nothing left
                os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"{what} hung for {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _run_launched(transport: str, launcher: list[str], module: str, nranks: int,
                  options: dict[str, object], timeout: float, extra: tuple[str, ...],
                  loop: str) -> None:
    env = dict(os.environ, MATE_TEST_TRANSPORT=transport, MATE_TEST_SIZE=str(nranks),
               MATE_TEST_OPTIONS=json.dumps(options), MATE_TEST_LOOP=loop,
               PYTHONUNBUFFERED="1")
    command = [*launcher, "-m", "pytest", str(TESTS / module), "-q", "-p", "no:cacheprovider",
               "-x", *extra]
    done = run_bounded(command, timeout, f"{module} on {nranks} ranks {options} ({loop})", env)
    if done.returncode != 0:
        pytest.fail(f"{module} on {nranks} ranks {options} ({loop}) failed "
                    f"(exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    # Ranks' lines can interleave on one line: count the summaries, not the lines.
    summaries = re.findall(r"\b\d+ passed\b", done.stdout)
    assert len(summaries) == nranks, f"expected a pytest summary per rank:\n{done.stdout}"
