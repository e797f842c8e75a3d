"""The transport registry: one table for startup, spmd, mate-bench, mate-run and the tests."""

from __future__ import annotations

import argparse

import pytest

import mate
from mate import registry
from mate.bench import cli
from mate.spmd import add_arguments


def test_every_entry_point_reads_the_one_table() -> None:
    names = tuple(registry.TRANSPORTS)
    assert tuple(mate.TRANSPORTS) == names and {"local", "mpi"} <= set(names)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    transport = next(a for a in parser._actions if a.dest == "transport")
    assert tuple(transport.choices) == names  # type: ignore[arg-type]
    bench = next(a for a in cli.build_parser()._actions if a.dest == "transport")
    assert tuple(bench.choices) == names  # type: ignore[arg-type]
    assert registry.launched() == tuple(n for n, e in registry.TRANSPORTS.items() if e.launcher)


def test_options_are_checked_with_their_defaults_filled_in() -> None:
    mpi = registry.TRANSPORTS["mpi"]
    assert mpi.resolve(None, "loop", {}) == {"progress": "poll", "rma": "auto",
                                             "rma_threshold": 64 * 1024,
                                             "eager_size": 4096, "orphan_limit": 4096,
                                             "shutdown_timeout": 5.0}
    assert mpi.resolve("thread", "progress", {"rma": "emulated"})["rma"] == "emulated"
    bad = [("poll", "progress", {}), ("spin", "loop", {}), (None, "loop", {"rma": "magic"}),
           (None, "loop", {"eager_size": -1}), (None, "loop", {"orphan_limit": 0}),
           (None, "loop", {"rma_threshold": -1}), (None, "loop", {"rma_threshold": "64K"}),
           (None, "loop", {"shutdown_timeout": float("inf")}), (None, "loop", {"colour": 1}),
           (None, "threads", {})]
    for progress, handlers, options in bad:
        with pytest.raises(mate.InvalidArgument):
            mpi.resolve(progress, handlers, options)
    local = registry.TRANSPORTS["local"]
    assert local.resolve(None, "loop", {}) == {"eager_limit": 64 * 1024}
    assert local.handlers == ("loop",)
    for progress, handlers in (("poll", "loop"), (None, "progress")):
        with pytest.raises(mate.InvalidArgument):
            local.resolve(progress, handlers, {})


def test_ibverbs_options() -> None:
    ib = registry.TRANSPORTS["ibverbs"]
    assert ib.resolve(None, "loop", {}) == {"progress": "loop", "device": None, "link": "unix",
                                            "eager_size": 8192, "credits": 32,
                                            "pin_limit": 256 * 2**20}
    assert ib.resolve("thread", "progress", {"device": "soft", "link": "tcp"})["link"] == "tcp"
    assert ib.launcher == "rendezvous" and ib.threaded_progress == ("thread",)
    bad = [("manual", "loop", {}), ("poll", "progress", {}), (None, "loop", {"device": "mlx5"}),
           (None, "loop", {"link": "udp"}), (None, "loop", {"credits": 1}),
           (None, "loop", {"credits": 4097}), (None, "loop", {"credits": True}),
           (None, "loop", {"eager_size": -1}), (None, "loop", {"pin_limit": 0}),
           (None, "loop", {"rma": "native"})]
    for progress, handlers, options in bad:
        with pytest.raises(mate.InvalidArgument):
            ib.resolve(progress, handlers, options)


def test_the_transport_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in registry.MPI_LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("MATE_TRANSPORT", raising=False)
    assert registry.choose(None).name == "local"
    assert cli.parse_args(["pingpong"]).transport == "local"
    monkeypatch.setenv("PMI_RANK", "0")
    assert registry.choose(None).name == "mpi"
    monkeypatch.setenv("MATE_TRANSPORT", "local")  # the variable wins, as in mate.startup
    assert registry.choose(None).name == "local"
    assert cli.parse_args(["pingpong"]).transport == "local"
    monkeypatch.setenv("MATE_TRANSPORT", "mpi")
    assert cli.parse_args(["pingpong"]).transport == "mpi"
    monkeypatch.delenv("PMI_RANK")
    monkeypatch.delenv("MATE_TRANSPORT")
    monkeypatch.setenv("MATE_RENDEZVOUS", "127.0.0.1:1")  # a rank started by mate-run
    assert registry.choose(None).name == "ibverbs"
    monkeypatch.delenv("MATE_RENDEZVOUS")
    monkeypatch.setenv("MATE_TRANSPORT", "carrier-pigeon")
    with pytest.raises(mate.InvalidArgument):
        registry.choose(None)
    with pytest.raises(SystemExit):
        cli.parse_args(["pingpong"])
