"""``python -m mate.litmus``: run the litmus tests on a transport and report.

    python -m mate.litmus --transport local [--ranks 3]
    mate-run -n 3 python -m mate.litmus --transport mpi [--progress thread]
    mate-run -n 3 --transport ibverbs python -m mate.litmus --transport ibverbs

Tests that need more ranks than the run has are skipped. Rank 0 prints a
row per test as it finishes, then the forbidden outcomes (if any) and a
summary; the exit status is 1 if any forbidden outcome was seen.
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import sys
from typing import Any

from mate import local, registry
from mate.litmus import report
from mate.litmus.catalogue import catalogue
from mate.litmus.language import Litmus
from mate.litmus.runner import LitmusRank, Result, open_hook
from mate.registry import choose


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mate.litmus",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=tuple(registry.TRANSPORTS), default=None,
                        help="default: $MATE_TRANSPORT, else the launcher's, else local")
    parser.add_argument("--progress", choices=registry.progress_modes(), default=None)
    parser.add_argument("--handlers", choices=("loop", "progress"), default="loop")
    parser.add_argument("--ranks", type=int, default=3,
                        help="ranks in this process, local transport only (default 3)")
    parser.add_argument("--iterations", type=int, default=10_000,
                        help="iterations of each test (default 10000)")
    parser.add_argument("--tests", nargs="*", default=None, metavar="PATTERN",
                        help="run the tests whose names match these shell patterns")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-jitter", dest="jitter", action="store_false",
                        help="no random delays at the transports' hot spots")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--list", action="store_true", help="list the tests and exit")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="print the --json files of earlier runs as one Markdown table "
                             "and exit")
    return parser.parse_args(argv)


def selected(patterns: list[str] | None) -> list[Litmus]:
    tests = catalogue()
    if patterns is None:
        return tests
    return [t for t in tests if any(fnmatch.fnmatchcase(t.name, p) for p in patterns)]


async def run(args: argparse.Namespace, tests: list[Litmus]) -> list[Result]:
    transport = choose(args.transport).name
    options: dict[str, Any] = {"handlers": args.handlers}
    if args.progress is not None:
        options["progress"] = args.progress

    def progress(result: Result) -> None:
        print(report.line(result), flush=True)

    if transport == "local":
        open_hook(args.jitter, args.seed)
        async with local.worlds(args.ranks) as worlds:
            open_hook(False, args.seed)
            async with local.worlds(args.ranks) as controls:
                ranks = [LitmusRank(w, c, seed=args.seed) for w, c in zip(worlds, controls,
                                                                           strict=True)]
                found = await asyncio.gather(*(r.run(tests, args.iterations,
                                                     progress if r.world.mypid == 0 else None)
                                               for r in ranks))
                return found[0]
    from mate import startup

    open_hook(args.jitter, args.seed)
    async with startup(transport, **options) as world:
        open_hook(False, args.seed)
        async with startup(transport, **options) as control:
            rank = LitmusRank(world, control, seed=args.seed)
            return await rank.run(tests, args.iterations,
                                  progress if world.mypid == 0 else None)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tests = selected(args.tests)
    if args.merge:
        runs = []
        for path in args.merge:
            with open(path) as file:
                runs.append(json.load(file))
        print(report.merged(runs))
        return 0
    if args.list:
        for test in tests:
            print(f"{test.name:28s} {test.ranks}  {test.about}")
        return 0
    results = asyncio.run(run(args, tests))
    if not results:  # not rank 0
        return 0
    print(report.table(results))
    details = report.forbidden_details(results)
    if details:
        print(details)
    print(report.summary(results), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            out.write(report.to_json(results, transport=choose(args.transport).name,
                                     progress=args.progress, handlers=args.handlers,
                                     jitter=args.jitter, seed=args.seed,
                                     iterations=args.iterations))
    return 1 if any(r.forbidden for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
