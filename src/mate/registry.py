"""The transports mate knows: one table that every entry point reads.

`mate.startup`, `mate.spmd`, `mate-bench`, `mate-run` and the tests take the
transport names, their options (with validators and defaults), their
progress and handler modes, and how their ranks are started from here, so
adding a transport is one entry in `TRANSPORTS`. An entry's opener is named
by module and function and imported only when it is used (the mpi transport
needs mpi4py, which is optional); it may be a coroutine function, for a
transport whose bootstrap waits for its peers.

Deadlines are the core's for every transport (`mate.deadlines`): on the loop,
or on a timeout thread where handlers run in a progress thread.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from mate import arguments
from mate.dispatch import MODES as HANDLER_MODES
from mate.errors import InvalidArgument

if TYPE_CHECKING:
    from mate.world import Opener, World

# Environment variables that MPI launchers set in the processes they start.
MPI_LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def launched_by_mpiexec() -> bool:
    return any(name in os.environ for name in MPI_LAUNCHER_VARIABLES)


@attrs.frozen
class Option:
    """A transport option: its default, its check (value -> value or InvalidArgument)."""

    default: Any
    check: Callable[[Any], Any]
    help: str


@attrs.frozen
class Entry:
    """One transport: how to open it, what it takes, what it can do."""

    name: str
    summary: str
    opener: str  # "module:function", called as opener(sink, loop, handlers=..., **options)
    options: Mapping[str, Option]
    progress: tuple[str, ...]  # its progress modes, the default first; () = none to choose
    threaded_progress: tuple[str, ...]  # the modes with a progress thread (handlers="progress")
    # how mate-run starts its ranks: "mpiexec", "rendezvous" (its own processes and an
    # endpoint exchange on loopback), or None: one process
    launcher: str | None
    detect: Callable[[], bool]  # True in a process started for this transport
    requires: str | None = None  # a module it cannot work without, and how to get it
    install: str = ""

    @property
    def handlers(self) -> tuple[str, ...]:
        """The handler modes it supports."""
        return HANDLER_MODES if self.threaded_progress else ("loop",)

    def resolve(self, progress: Any, handlers: Any, options: Mapping[str, Any]) -> dict[str, Any]:
        """Every option checked, defaults filled in (with `progress` if it has modes)."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            accepted = ", ".join(["default_timeout", "handlers",
                                  *(["progress"] if self.progress else []), *self.options])
            raise InvalidArgument(f"unknown option(s) {unknown} for the {self.name} transport; "
                                  f"it accepts {accepted}")
        arguments.choice(handlers, "handlers", HANDLER_MODES)
        resolved: dict[str, Any] = {}
        if not self.progress:
            if progress is not None:
                raise InvalidArgument(
                    f"the {self.name} transport progresses on the event loop; progress must "
                    f"be None, not {progress!r}")
        else:
            progress = self.progress[0] if progress is None else progress
            resolved["progress"] = arguments.choice(progress, "progress", self.progress)
        if handlers == "progress" and progress not in self.threaded_progress:
            raise InvalidArgument(
                f'handlers="progress" needs a progress thread: on the {self.name} transport '
                + (f"progress={self.threaded_progress[0]!r}" if self.threaded_progress
                   else "there is none; handlers run on the loop"))
        for name, option in self.options.items():
            resolved[name] = option.check(options.get(name, option.default))
        return resolved

    def load_opener(self) -> Opener:
        if self.requires is not None:
            try:
                importlib.import_module(self.requires)
            except ImportError as exc:
                raise InvalidArgument(f"the {self.name} transport needs {self.requires}: "
                                      f"{self.install}") from exc
        module, _, function = self.opener.partition(":")
        opener: Opener = getattr(importlib.import_module(module), function)
        return opener

    async def open(self, *, default_timeout: Any = 1.0, progress: Any = None,
                   handlers: Any = "loop", **options: Any) -> World:
        """This process's world on this transport."""
        from mate.world import open_world

        arguments.seconds(default_timeout, "default_timeout")
        resolved = self.resolve(progress, handlers, options)
        return await open_world(self.load_opener(), default_timeout=default_timeout,
                                handlers=handlers, **resolved)


def _bytes(name: str, minimum: int = 0) -> Callable[[Any], int]:
    return lambda value: arguments.count(value, name, minimum=minimum, unit="bytes")


TRANSPORTS: dict[str, Entry] = {
    entry.name: entry for entry in (
        Entry(
            name="local",
            summary="N ranks in one process and one event loop (tests, teaching)",
            opener="mate.transports.local:open_transport",
            options={"eager_limit": Option(
                64 * 1024, _bytes("eager_limit"),
                "sends up to this size are buffered at the destination and complete at once")},
            progress=(),
            threaded_progress=(),
            launcher=None,
            detect=lambda: False,
        ),
        Entry(
            name="mpi",
            summary="mpi4py over MPI (thesis §5.2, MPI-3 RMA); ranks started by mpiexec",
            opener="mate.transports.mpi:open_transport",
            options={
                "rma": Option("auto", lambda v: arguments.choice(
                    v, "rma", ("auto", "native", "emulated")),
                    "put/get: MPI-3 RMA (native), two-sided (emulated), or by size (auto)"),
                "rma_threshold": Option(64 * 1024, _bytes("rma_threshold"),
                                        "rma=auto: puts and gets of this size and up go "
                                        "two-sided"),
                "eager_size": Option(4096, _bytes("eager_size"),
                                     "sends up to this size go from a copy, submitted at once"),
                "orphan_limit": Option(4096, lambda v: arguments.count(
                    v, "orphan_limit", minimum=1), "unreceived timed-out sends kept per peer"),
                "shutdown_timeout": Option(5.0, lambda v: arguments.seconds(
                    v, "shutdown_timeout"), "how long shutdown waits for the other ranks"),
            },
            progress=("poll", "thread", "manual"),
            threaded_progress=("thread",),
            launcher="mpiexec",
            detect=launched_by_mpiexec,
            requires="mpi4py",
            install="pip install 'mate-messages[mpi]'",
        ),
        Entry(
            name="ibverbs",
            summary="InfiniBand verbs (thesis §5.3): pyverbs on an HCA, else a software RC "
                    "device; ranks started by mate-run (or mpiexec)",
            opener="mate.transports.ibverbs:open_transport",
            options={
                "device": Option(None, lambda v: None if v is None else arguments.choice(
                    v, "device", ("soft", "pyverbs")),
                    "None: pyverbs when an HCA exists, else the software device"),
                "link": Option("unix", lambda v: arguments.choice(v, "link", ("unix", "tcp")),
                               "how the software device connects its QPs"),
                "eager_size": Option(8192, _bytes("eager_size"),
                                     "sends up to this size are copied (eager), larger ones "
                                     "are RDMA-read by the receiver (rendezvous)"),
                "credits": Option(32, lambda v: arguments.count(
                    v, "credits", minimum=2, maximum=4096),
                                  "receive descriptors pre-posted per peer"),
                "pin_limit": Option(256 * 2**20, _bytes("pin_limit", minimum=1),
                                    "bytes of user memory the pin cache keeps registered"),
            },
            progress=("loop", "poll", "thread"),
            threaded_progress=("thread",),
            launcher="rendezvous",
            detect=lambda: "MATE_RENDEZVOUS" in os.environ,
        ),
    )
}


def choose(name: str | None) -> Entry:
    """The transport called `name`; None: $MATE_TRANSPORT, else the one whose launcher
    started this process, else local."""
    if name is None:
        name = os.environ.get("MATE_TRANSPORT") or next(
            (entry.name for entry in TRANSPORTS.values() if entry.detect()), "local")
    if not isinstance(name, str) or name not in TRANSPORTS:  # (a list cannot even be looked up)
        raise InvalidArgument(f"unknown transport {name!r}; available: {tuple(TRANSPORTS)}")
    return TRANSPORTS[name]


def launched() -> tuple[str, ...]:
    """The transports whose ranks `mate-run` starts."""
    return tuple(name for name, entry in TRANSPORTS.items() if entry.launcher is not None)


def progress_modes() -> tuple[str, ...]:
    """Every transport's progress modes, for command-line choices."""
    return tuple(dict.fromkeys(mode for entry in TRANSPORTS.values() for mode in entry.progress))
