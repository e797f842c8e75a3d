"""Run one program on every rank, whatever the transport (the demos' entry point).

SPMD programs are written once, as ``async def program(world) -> result``.
`run` gives them their worlds: with the local transport, `ranks` worlds in
this process and one event loop (the program runs once per rank,
concurrently); under a launcher (``mate-run -n N`` / ``mpiexec -n N``), this
process's one world. `add_arguments` gives every demo the same options.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from mate import local, registry
from mate.errors import InvalidArgument
from mate.world import World

T = TypeVar("T")

DEFAULT_LOCAL_RANKS = 2


def chosen(transport: str | None) -> str:
    """The transport `run` uses for `transport` (None: from the environment)."""
    return registry.choose(transport).name


async def run(program: Callable[[World], Awaitable[T]], *, transport: str | None = None,
              ranks: int | None = None, **options: Any) -> list[T]:
    """Run `program` on every rank this process holds; return their results in rank order."""
    from mate import startup

    transport = chosen(transport)
    if transport == "local":
        async with local.worlds(DEFAULT_LOCAL_RANKS if ranks is None else ranks,
                                **options) as worlds:
            tasks = [asyncio.ensure_future(program(world)) for world in worlds]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                # One rank's error must not leave the others running past shutdown.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    if ranks is not None:
        raise InvalidArgument(
            f"ranks={ranks} is for the local transport; under a launcher the number of "
            f"ranks is the launcher's (mate-run -n N)")
    async with startup(transport, **options) as world:
        return [await program(world)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every demo takes: transport, ranks, progress, handlers."""
    group = parser.add_argument_group("transport")
    group.add_argument("--transport", choices=tuple(registry.TRANSPORTS), default=None,
                       help="default: $MATE_TRANSPORT, else mpi under mpiexec, else local")
    group.add_argument("--ranks", type=int, default=None,
                       help=f"ranks in this process, local transport only "
                            f"(default {DEFAULT_LOCAL_RANKS})")
    group.add_argument("--progress", choices=registry.progress_modes(), default=None,
                       help="mpi progress mode (default poll)")
    group.add_argument("--handlers", choices=("loop", "progress"), default="loop",
                       help='where handlers run; "progress" needs --progress thread')


def options_from(args: argparse.Namespace) -> dict[str, Any]:
    """`run`'s keyword arguments from the options `add_arguments` defined."""
    options: dict[str, Any] = {"transport": args.transport, "ranks": args.ranks,
                               "handlers": args.handlers}
    if args.progress is not None:
        options["progress"] = args.progress
    return options
