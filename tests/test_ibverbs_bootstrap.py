"""The ibverbs bootstrap: mate-run's rendezvous, its secret, and mate-run's local launcher."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from launch import run_bounded

from mate.transports.ibverbs import bootstrap


async def _exchange_as(env: dict[str, str], blob: object) -> list[object]:
    """One simulated rank's exchange, with mate-run's environment `env` (never this
    process's: ranks run concurrently here)."""
    return await bootstrap.exchange(blob, env)


async def test_the_rendezvous_hands_every_rank_the_table_in_rank_order() -> None:
    server = bootstrap.Rendezvous(3)
    await server.start()
    try:
        async def rank(r: int) -> list[object]:
            return await _exchange_as(server.environment(r), {"rank": r})

        tables = await asyncio.gather(rank(2), rank(0), rank(1))
    finally:
        await server.close()
    assert tables == [[{"rank": 0}, {"rank": 1}, {"rank": 2}]] * 3
    assert server.refused == 0


async def _raw_hello(address: str, hello: dict[str, object]) -> dict[str, object]:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    json.loads(await reader.readline())  # the challenge
    writer.write(json.dumps(hello).encode() + b"\n")
    await writer.drain()
    reply: dict[str, object] = json.loads(await reader.readline())
    writer.close()
    return reply


async def test_a_process_without_the_secret_is_refused_and_the_job_goes_on() -> None:
    server = bootstrap.Rendezvous(2)
    address = await server.start()
    try:
        forged = await _raw_hello(address, {"rank": 0, "proof": "00" * 32, "blob": "evil"})
        assert forged == {"error": "refused"}
        malformed = await _raw_hello(address, {"rank": "zero"})
        assert malformed == {"error": "refused"}
        assert server.refused == 2

        async def rank(r: int) -> list[object]:
            return await _exchange_as(server.environment(r), f"blob{r}")

        tables = await asyncio.gather(rank(0), rank(1))
    finally:
        await server.close()
    assert tables == [["blob0", "blob1"]] * 2  # the forged blob never got in


async def test_a_rank_cannot_check_in_twice_for_one_world() -> None:
    server = bootstrap.Rendezvous(2)
    address = await server.start()
    try:
        first = asyncio.ensure_future(_exchange_as(server.environment(0), "a"))
        await asyncio.sleep(0.2)
        # an impostor who knows the secret, claiming rank 0's place while rank 0 waits
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        challenge = json.loads(await reader.readline())["challenge"]
        writer.write(json.dumps({"rank": 0, "blob": "again",
                                 "proof": bootstrap._proof(server.secret, challenge)})
                     .encode() + b"\n")
        await writer.drain()
        assert json.loads(await reader.readline()) == {"error": "refused"}
        writer.close()
        second = await _exchange_as(server.environment(1), "b")
        assert await first == second == ["a", "b"]
        assert server.refused == 1
    finally:
        await server.close()


async def test_successive_worlds_in_one_process_meet_afresh() -> None:
    server = bootstrap.Rendezvous(2)
    await server.start()
    try:
        async def rank(r: int) -> list[list[object]]:
            tables = []
            for world in range(3):
                tables.append(await _exchange_as(server.environment(r), (world, r)))
                await asyncio.sleep(0.05 * r)  # rank 1 lags: worlds must not mix
            return tables

        zero, one = await asyncio.gather(rank(0), rank(1))
    finally:
        await server.close()
    assert zero == one == [[[w, 0], [w, 1]] for w in range(3)]
    assert server.refused == 0


async def test_once_a_rank_ended_no_world_can_form_and_its_peers_are_told() -> None:
    server = bootstrap.Rendezvous(3)
    await server.start()
    try:
        waiting = asyncio.ensure_future(_exchange_as(server.environment(0), "a"))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        server.ended(2, "1")
        with pytest.raises(ConnectionError, match="rank 0: rank 2 ended with status 1 before"):
            await asyncio.wait_for(waiting, 10)
        with pytest.raises(ConnectionError, match="refused rank 1: rank 2 ended"):
            await asyncio.wait_for(_exchange_as(server.environment(1), "b"), 10)
        assert server.refused == 0  # they proved the secret: refused for the world, not them
    finally:
        await server.close()


def test_this_process_is_left_alone() -> None:
    """The tests above simulate ranks without touching this process's environment."""
    assert not bootstrap.started_by_mate_run()


def _mate_run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_bounded([sys.executable, "-m", "mate.run", *args], timeout, "mate-run")


def test_mate_run_starts_local_ranks_with_the_rendezvous_environment() -> None:
    code = ("import os; print(os.environ['MATE_TRANSPORT'], os.environ['MATE_RANK'], "
            "os.environ['MATE_SIZE'], 'MATE_SECRET' in os.environ)")
    done = _mate_run("-n", "3", "--transport", "ibverbs", "python", "-c", code)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        f"[{r}] ibverbs {r} 3 True" for r in range(3)]


def test_mate_run_reports_a_dead_rank_and_lets_the_others_finish() -> None:
    code = ("import os, signal, time, sys\n"
            "rank = int(os.environ['MATE_RANK'])\n"
            "if rank == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(1.0)\n"
            "print('finished', rank, flush=True)\n")
    done = _mate_run("-n", "3", "--transport", "ibverbs", "python", "-c", code)
    assert done.returncode == 137
    assert "mate-run: rank 1 exited with status 137 (killed by SIGKILL)" in done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0] finished 0", "[2] finished 2"]


def test_mate_run_refuses_a_world_whose_rank_ended_instead_of_hanging() -> None:
    """Rank 1 ends without starting; rank 0's startup fails at once, naming it."""
    code = ("import asyncio, os, sys\n"
            "import mate\n"
            "if os.environ['MATE_RANK'] == '1': sys.exit(3)\n"
            "async def main():\n"
            "    async with mate.startup('ibverbs'):\n"
            "        pass\n"
            "try:\n"
            "    asyncio.run(main())\n"
            "except ConnectionError as exc:\n"
            "    print('refused:', exc, flush=True)\n"
            "    sys.exit(5)\n")
    done = _mate_run("-n", "2", "--transport", "ibverbs", "python", "-c", code)
    assert done.returncode == 5, done.stderr
    assert done.stdout.splitlines() == [
        "[0] refused: the rendezvous refused rank 0: rank 1 ended with status 3 before "
        "every rank checked in"]
    assert "mate-run: rank 1 exited with status 3" in done.stderr
