"""mate-run with MPICH's mpiexec (hydra): output by rank, exit codes, and a rank that dies.

Each test writes a small program to tmp_path and runs ``mate-run -n N`` on it,
as a user would, then reads what mate-run printed and returned.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import LAUNCHED

from mate.run import find_mpiexec, is_hydra

pytest.importorskip("mpi4py")


def hydra() -> bool:
    try:
        return is_hydra(find_mpiexec())
    except SystemExit:  # no mpiexec at all
        return False


pytestmark = [
    pytest.mark.skipif(LAUNCHED is not None, reason="this is the launcher"),
    pytest.mark.skipif(not hydra(), reason="needs MPICH's mpiexec (hydra)"),
]

BOUND = 30.0  # seconds: nothing here may hang (each run takes 1 to 3 s)


def mate_run(tmp_path: Path, nranks: int, program: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(program))
    command = [sys.executable, "-m", "mate.run", "-n", str(nranks), "python", str(script)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=tmp_path) as run:
        try:
            out, err = run.communicate(timeout=BOUND)
        except subprocess.TimeoutExpired:
            run.terminate()  # mate-run passes it on to the ranks: none is left behind
            try:
                out, err = run.communicate(timeout=10)
            finally:
                run.kill()
            pytest.fail(f"mate-run hung for {BOUND} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(command, run.returncode, out, err)


def test_each_line_is_prefixed_with_its_rank_and_the_first_failure_returned(
        tmp_path: Path) -> None:
    done = mate_run(tmp_path, 3, """
        import os, sys
        rank = int(os.environ["PMI_RANK"])
        sys.stdout.write("hello ")  # one line written in two pieces
        sys.stdout.flush()
        sys.stdout.write(f"from {rank}\\n")
        print(f"trouble on {rank}", file=sys.stderr)
        sys.exit(rank + 3 if rank else 0)
    """)
    out, err = done.stdout.splitlines(), done.stderr.splitlines()
    assert sorted(out) == ["[0] hello from 0", "[1] hello from 1", "[2] hello from 2"], done
    assert {"[0] trouble on 0", "[1] trouble on 1", "[2] trouble on 2"} <= set(err), done
    assert err[-2:] == ["mate-run: rank 1 exited with status 4",
                        "mate-run: rank 2 exited with status 5"], done
    assert done.returncode == 4  # the lowest failing rank's, not hydra's 4 | 5


DEAD_RANK = """
    import asyncio, os, signal
    import mate

    async def main() -> None:
        async with mate.startup("mpi", shutdown_timeout=0.5) as world:
            me, n = world.mypid, world.numprocs
            ring = world.recv(bytearray(1), (me - 1) % n, tag=1, timeout=10)
            await world.send(b"!", (me + 1) % n, tag=1, timeout=10)
            await ring  # every rank is up
            if me == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            other = 2 - me
            for i in range(20):
                data = bytearray(8)
                recv = world.recv(data, other, tag=i, timeout=10)
                await world.send(i.to_bytes(8, "little"), other, tag=i, timeout=10)
                await recv
                assert int.from_bytes(data, "little") == i
            for msg in (world.send(b"?", 1, tag=99, timeout=0.3),
                        world.recv(bytearray(1), 1, tag=99, timeout=0.3)):
                try:
                    await msg
                except mate.MessageTimeout:
                    print(f"rank {me}: {msg.op.name.lower()} with rank 1 timed out", flush=True)
            print(f"rank {me}: exchanges completed", flush=True)
        print(f"rank {me}: shutdown returned", flush=True)

    asyncio.run(main())
"""


def test_a_dead_rank_is_named_and_the_others_finish(tmp_path: Path) -> None:
    done = mate_run(tmp_path, 3, DEAD_RANK)
    out = done.stdout.splitlines()
    for me in (0, 2):
        assert f"[{me}] rank {me}: send with rank 1 timed out" in out, done
        assert f"[{me}] rank {me}: recv with rank 1 timed out" in out, done
        assert f"[{me}] rank {me}: exchanges completed" in out, done
        assert f"[{me}] rank {me}: shutdown returned" in out, done
    report = [line for line in done.stderr.splitlines() if line.startswith("mate-run:")]
    assert report == ["mate-run: rank 1 exited with status 137 (killed by SIGKILL)"], done
    assert done.returncode == 137
    assert "was not returned to mpool" not in done.stdout + done.stderr, done


def test_a_shutdown_that_gave_up_leaves_no_request_to_mpi(tmp_path: Path) -> None:
    # Rank 1 gives up waiting for rank 0 at shutdown; both live on and finalize.
    # Receives still posted then were requests MPI never got back: UCX warned at exit.
    done = mate_run(tmp_path, 2, """
        import asyncio
        import mate

        async def main() -> None:
            world = await mate.startup("mpi", shutdown_timeout=0.3)
            world.recv(bytearray(8), 1 - world.mypid, tag=5)
            if world.mypid == 0:
                await asyncio.sleep(1.0)
            await world.shutdown()
            print(f"rank {world.mypid}: shutdown returned", flush=True)

        asyncio.run(main())
    """)
    assert done.returncode == 0, done
    assert sorted(done.stdout.splitlines()) == ["[0] rank 0: shutdown returned",
                                                "[1] rank 1: shutdown returned"], done
    assert "not every rank reached shutdown" in done.stderr, done
    assert "was not returned to mpool" not in done.stdout + done.stderr, done


def test_a_rank_that_dies_after_every_rank_shut_down_does_not_hang_the_others(
        tmp_path: Path) -> None:
    # The ranks met at shutdown; MPI_Finalize must not wait for rank 1 all the same.
    done = mate_run(tmp_path, 3, """
        import asyncio, os, signal, time
        import mate

        async def main() -> None:
            async with mate.startup("mpi") as world:
                me = world.mypid
            if me == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.5)
            print(f"rank {me}: done", flush=True)

        asyncio.run(main())
    """)
    assert sorted(done.stdout.splitlines()) == ["[0] rank 0: done", "[2] rank 2: done"], done
    assert done.stderr.splitlines()[-1:] == [
        "mate-run: rank 1 exited with status 137 (killed by SIGKILL)"], done
    assert done.returncode == 137
