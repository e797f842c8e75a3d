"""The MPI control channel's messages: every kind survives encode/decode, nothing else does."""

from __future__ import annotations

import pytest

from mate.transports.mpi import control as c


@pytest.mark.parametrize("message", [
    c.TableRequest(17),
    c.Table(3, ((0x1000, 64), (2**63, 2**20))),
    c.Table(0, ()),
    c.Revoke(2**40),
    c.RevokeAck(5),
    c.Get(99, 0xdeadbeef, 4096),
    c.GetRefused(2**31 - 1),
    c.Put(18, 0x2000, b"payload"),
    c.Put(19, 0, b""),
    c.PutRequest(20, 0x3000, 1 << 22),
    c.Reply(True, 21),
    c.Reply(False),
    c.Nudge(1 << 22, True),
    c.Nudge(1 << 16, False),
    c.Lease(True),
    c.Lease(False),
])
def test_every_message_round_trips(message: c.Control) -> None:
    data = message.encode()
    assert data[0] == message.KIND
    assert c.decode(memoryview(data)) == message


def test_table_replies_fit_their_buffer_and_are_capped() -> None:
    full = c.Table(1, tuple((i * 16, 16) for i in range(c.MAX_REGIONS + 5)))
    data = full.encode()
    assert len(data) == c.Table.MAX_SIZE
    assert len(c.decode(memoryview(data)).regions) == c.MAX_REGIONS  # type: ignore[union-attr]


def test_what_is_no_control_message_is_refused() -> None:
    for data in (b"", b"\x00", b"\xff" + bytes(20)):
        with pytest.raises(ValueError):
            c.decode(memoryview(data))
