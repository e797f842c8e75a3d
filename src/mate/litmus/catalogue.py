"""The litmus tests: the shapes of SPEC §1-§2 worth checking, each in its variants.

A shape comes with and without waiting for the event it is about (``-wait``
and ``-nowait``), and in a loopback version (``-self``: the operations
target the rank itself) where that makes sense. Expected outcomes are never
written here: `mate.litmus.model` computes them from the spec's rules. Names
follow seed 000's style: MP is message passing, WAW write-after-write; the
``about`` line says what the test checks.

Values: every variable starts at 0 unless it is a source, which starts at a
distinct small value, so that an outcome says which write it saw.
"""

from __future__ import annotations

from mate.constants import ANY_SOURCE, ANY_TAG
from mate.litmus.language import (
    Cancel,
    Get,
    Instruction,
    Litmus,
    Put,
    Read,
    Recv,
    Send,
    Var,
    Wait,
    WaitFor,
    Write,
    litmus,
)

GO = 9  # the tag of "I have posted my receives" messages


def _waited(wait: bool, *instructions: Instruction) -> list[Instruction]:
    return list(instructions) if wait else []


def _variants(wait_name: str) -> tuple[tuple[str, bool], ...]:
    return ((f"-{wait_name}", True), ("-nowait", False))


def get_then_write() -> list[Litmus]:
    tests = []
    for suffix, wait in _variants("wait"):
        for loop in (False, True):
            src = 0 if loop else 1
            memory = [[Var("d"), Var("x", init=7)]] if loop else [[Var("d")], [Var("x", init=7)]]
            program: list[Instruction] = [Get("g", "d", src, "x"), *_waited(wait, Wait("g")),
                                          Write("d", 9), Wait("g")]
            programs = [program] if loop else [program, []]
            tests.append(litmus(
                f"get-write{suffix}{'-self' if loop else ''}",
                "a local write after a get's completion is not overwritten by the get",
                memory, programs, final=[(0, "d")]))
    return tests


def put_then_reuse() -> list[Litmus]:
    tests = []
    for suffix, wait in _variants("submission"):
        for loop in (False, True):
            dest = 0 if loop else 1
            memory = [[Var("s", init=1), Var("x")]] if loop else [[Var("s", init=1)], [Var("x")]]
            program: list[Instruction] = [Put("p", "s", dest, "x"),
                                          *_waited(wait, Wait("p", "submission")),
                                          Write("s", 2), Wait("p")]
            tests.append(litmus(
                f"put-reuse{suffix}{'-self' if loop else ''}",
                "a put's buffer may be reused once it is submitted",
                memory, [program] if loop else [program, []], final=[(dest, "x")]))
    return tests


def send_then_reuse() -> list[Litmus]:
    tests = []
    for suffix, wait in _variants("submission"):
        for loop in (False, True):
            dest = 0 if loop else 1
            sender: list[Instruction] = [Send("m", "s", dest, 1),
                                         *_waited(wait, Wait("m", "submission")),
                                         Write("s", 2)]
            receiver: list[Instruction] = [Recv("r", "b", 0, 1), Wait("r"), Read("b", "v")]
            if loop:
                memory, programs = [[Var("s", init=1), Var("b")]], [sender + receiver]
            else:
                memory, programs = [[Var("s", init=1)], [Var("b")]], [sender, receiver]
            tests.append(litmus(
                f"send-reuse{suffix}{'-self' if loop else ''}",
                "a send's buffer may be reused once it is submitted",
                memory, programs))
    return tests


def message_passing() -> list[Litmus]:
    tests = []
    for suffix, wait in _variants("wait"):
        sender: list[Instruction] = [Put("data", "s", 1, "x"), *_waited(wait, Wait("data")),
                                     Put("flag", "one", 1, "f"), Wait("flag"), Wait("data")]
        memory = [[Var("s", init=1), Var("one", init=1)], [Var("x"), Var("f")]]
        tests.append(litmus(
            f"MP+put+put{suffix}",
            "data put, then flag put: a reader who sees the flag sees the data if the "
            "data's completion was awaited first",
            memory, [sender, [WaitFor("f", 1), Read("x", "b")]]))
        tests.append(litmus(
            f"MP+put+put-peek{suffix}",
            "as MP+put+put, the reader reading the flag once, then the data",
            memory, [sender, [Read("f", "a"), Read("x", "b")]]))
        tests.append(litmus(
            f"MP+put+send{suffix}",
            "data put, then a message as the flag: its receiver sees the data if the "
            "put's completion was awaited first",
            [[Var("s", init=1), Var("t", init=5)], [Var("x"), Var("fl")]],
            [[Put("data", "s", 1, "x"), *_waited(wait, Wait("data")), Send("flag", "t", 1, 1),
              Wait("data")],
             [Recv("r", "fl", 0, 1), Wait("r"), Read("x", "b")]]))
    return tests


def send_completion() -> list[Litmus]:
    """Send completion means the data reached the destination (SPEC §1's table)."""
    tests = []
    for suffix, wait in _variants("wait"):
        tests.append(litmus(
            f"SC+send+send{suffix}",
            "a message sent after another's completion cannot match a receive posted "
            "before both (the first is already in that receive)",
            [[Var("a", init=1), Var("b", init=2), Var("g2")], [Var("b1"), Var("b2"), Var("g")]],
            [[Recv("go", "g2", 1, GO), Wait("go"), Send("ma", "a", 1, 1),
              *_waited(wait, Wait("ma")), Send("mb", "b", 1, 2)],
             [Recv("r1", "b1", 0, ANY_TAG), Send("ready", "g", 0, GO), Recv("r2", "b2", 0, ANY_TAG),
              Wait("r1"), Wait("r2"), Read("b1", "first")]]))
        tests.append(litmus(
            f"SC+send+put{suffix}",
            "send, await its completion, put a flag: a receiver that sees the flag cannot "
            "cancel the receive the message matched",
            [[Var("m", init=5), Var("one", init=1), Var("g2")], [Var("b"), Var("f"), Var("g")]],
            [[Recv("go", "g2", 1, GO), Wait("go"), Send("msg", "m", 1, 1),
              *_waited(wait, Wait("msg")), Put("flag", "one", 1, "f"), Wait("flag")],
             [Recv("r", "b", 0, 1), Send("ready", "g", 0, GO), WaitFor("f", 1), Cancel("r"),
              Wait("r")]],
            final=[(1, "b")]))
        tests.append(litmus(
            f"SC+3{suffix}",
            "three ranks: a message sent after a flag that followed another message's "
            "completion cannot overtake it into a receive posted before both",
            [[Var("v", init=1), Var("t", init=3), Var("g2")], [Var("w", init=2), Var("fl")],
             [Var("b1"), Var("b2"), Var("g")]],
            [[Recv("go", "g2", 2, GO), Wait("go"), Send("m0", "v", 2, 1),
              *_waited(wait, Wait("m0")), Send("flag", "t", 1, 3)],
             [Recv("fr", "fl", 0, 3), Wait("fr"), Send("m1", "w", 2, 1)],
             [Recv("r1", "b1", ANY_SOURCE, 1), Send("ready", "g", 0, GO),
              Recv("r2", "b2", ANY_SOURCE, 1), Wait("r1"), Wait("r2"), Read("b1", "first")]]))
    return tests


def put_get() -> list[Litmus]:
    """Seed 000's Figs 6 and 8: a put and a get to one target are not ordered."""
    tests = []
    for suffix, wait in _variants("wait"):
        tests.append(litmus(
            f"PG{suffix}",
            "put then get to one target (seed 000 Fig 6): unordered unless the put's "
            "completion is awaited",
            [[Var("x", init=1)], [Var("y")]],
            [[Read("x", "a")],
             [Put("p", "y", 0, "x"), *_waited(wait, Wait("p")), Get("g", "y", 0, "x"),
              Wait("p"), Wait("g"), Read("y", "b")]]))
        tests.append(litmus(
            f"GP{suffix}",
            "get then put to one target (seed 000 Fig 8) while the target writes",
            [[Var("x", init=1)], [Var("y")]],
            [[Read("x", "a"), Write("x", 2), Read("x", "b")],
             [Get("g", "y", 0, "x"), *_waited(wait, Wait("g")), Put("p", "y", 0, "x"),
              Wait("g"), Wait("p"), Read("y", "c")]]))
    return tests


def write_after_write() -> list[Litmus]:
    tests = []
    for suffix, wait in _variants("wait"):
        for loop in (False, True):
            dest = 0 if loop else 1
            memory = ([[Var("s1", init=1), Var("s2", init=2), Var("x")]] if loop
                      else [[Var("s1", init=1), Var("s2", init=2)], [Var("x")]])
            program: list[Instruction] = [Put("p1", "s1", dest, "x"),
                                          *_waited(wait, Wait("p1")),
                                          Put("p2", "s2", dest, "x"), Wait("p2"), Wait("p1")]
            tests.append(litmus(
                f"WAW{suffix}{'-self' if loop else ''}",
                "two puts to one place: the later wins if the first's completion was awaited",
                memory, [program] if loop else [program, []], final=[(dest, "x")]))
    return tests


def two_gets() -> list[Litmus]:
    tests = []
    for suffix, wait in _variants("wait"):
        for loop in (False, True):
            src = 0 if loop else 1
            target = [Var("x", 2, init=1), Var("y", 2, init=2)]
            memory = [[Var("d", 2), *target]] if loop else [[Var("d", 2)], target]
            program: list[Instruction] = [Get("g1", "d", src, "x"), *_waited(wait, Wait("g1")),
                                          Get("g2", "d", src, "y"), Wait("g2"), Wait("g1")]
            tests.append(litmus(
                f"GG{suffix}{'-self' if loop else ''}",
                "two gets into one buffer: byte by byte either, unless the first was awaited",
                memory, [program] if loop else [program, []], final=[(0, "d")]))
    return tests


def completion_scope() -> list[Litmus]:
    return [
        litmus("scope-2",
               "one put's completion says nothing of another's: the reader sees the awaited "
               "put's data, and either value of the other",
               [[Var("s", init=1), Var("t", init=3)], [Var("x"), Var("y"), Var("fl")]],
               [[Put("p1", "s", 1, "x"), Put("p2", "s", 1, "y"), Wait("p1"),
                 Send("flag", "t", 1, 1), Wait("p2")],
                [Recv("r", "fl", 0, 1), Wait("r"), Read("x", "bx"), Read("y", "by")]]),
        litmus("scope-3",
               "as scope-2 with the puts to two ranks, each told by a message",
               [[Var("s", init=1), Var("t", init=3)], [Var("x"), Var("fl")],
                [Var("y"), Var("fl")]],
               [[Put("p1", "s", 1, "x"), Put("p2", "s", 2, "y"), Wait("p1"),
                 Send("f1", "t", 1, 1), Send("f2", "t", 2, 1), Wait("p2")],
                [Recv("r1", "fl", 0, 1), Wait("r1"), Read("x", "bx")],
                [Recv("r2", "fl", 0, 1), Wait("r2"), Read("y", "by")]]),
    ]


def send_order() -> list[Litmus]:
    tests = []
    for loop in (False, True):
        dest = 0 if loop else 1
        sender: list[Instruction] = [Send("m1", "a", dest, 1), Send("m2", "b", dest, 1)]
        receiver: list[Instruction] = [Recv("r1", "b1", 0, 1), Recv("r2", "b2", 0, 1),
                                       Wait("r1"), Wait("r2"), Read("b1", "x"), Read("b2", "y")]
        sources = [Var("a", init=1), Var("b", init=2)]
        buffers = [Var("b1"), Var("b2")]
        tests.append(litmus(
            f"SS{'-self' if loop else ''}",
            "two sends on one channel match receives in posting order (non-overtaking)",
            [sources + buffers] if loop else [sources, buffers],
            [sender + receiver] if loop else [sender, receiver]))
    tests.append(litmus(
        "SS-tags",
        "two sends with different tags may match ANY_TAG receives in either order",
        [[Var("a", init=1), Var("b", init=2)], [Var("b1"), Var("b2")]],
        [[Send("m1", "a", 1, 1), Send("m2", "b", 1, 2)],
         [Recv("r1", "b1", 0, ANY_TAG), Recv("r2", "b2", 0, ANY_TAG), Wait("r1"), Wait("r2"),
          Read("b1", "x"), Read("b2", "y")]]))
    tests.append(litmus(
        "SS-sources",
        "messages from two senders may match ANY_SOURCE receives in either order, each "
        "sender's in its own order",
        [[Var("a", init=1), Var("b", init=2)], [Var("c", init=3)],
         [Var("b1"), Var("b2"), Var("b3")]],
        [[Send("m1", "a", 2, 1), Send("m2", "b", 2, 1)], [Send("m3", "c", 2, 1)],
         [Recv("r1", "b1", ANY_SOURCE, 1), Recv("r2", "b2", ANY_SOURCE, 1),
          Recv("r3", "b3", ANY_SOURCE, 1), Wait("r1"), Wait("r2"), Wait("r3"),
          Read("b1", "x"), Read("b2", "y"), Read("b3", "z")]]))
    return tests


def causality() -> list[Litmus]:
    tests = []
    for suffix, wait in _variants("wait"):
        tests.append(litmus(
            f"causal-3{suffix}",
            "put, await completion, flag a third rank, which then gets: it sees the data",
            [[Var("s", init=1), Var("t", init=3)], [Var("x")], [Var("fl"), Var("d")]],
            [[Put("p", "s", 1, "x"), *_waited(wait, Wait("p")), Send("flag", "t", 2, 1),
              Wait("p")],
             [],
             [Recv("r", "fl", 0, 1), Wait("r"), Get("g", "d", 1, "x"), Wait("g"),
              Read("d", "v")]]))
    return tests


def write_before_issue() -> list[Litmus]:
    return [
        litmus("write-put", "a write before a put's call is what the put carries",
               [[Var("s")], [Var("x")]],
               [[Write("s", 5), Put("p", "s", 1, "x"), Wait("p")], []], final=[(1, "x")]),
        litmus("write-send", "a write before a send's call is what the send carries",
               [[Var("s")], [Var("b")]],
               [[Write("s", 5), Send("m", "s", 1, 1)],
                [Recv("r", "b", 0, 1), Wait("r"), Read("b", "v")]]),
        litmus("write-get", "a write at the target before the message that precedes a get "
               "is what the get reads",
               [[Var("d"), Var("fl")], [Var("x"), Var("t", init=3)]],
               [[Recv("r", "fl", 1, 1), Wait("r"), Get("g", "d", 1, "x"), Wait("g"),
                 Read("d", "v")],
                [Write("x", 5), Send("flag", "t", 0, 1)]]),
    ]


def overlapping_puts() -> list[Litmus]:
    a, b = Var("A", 4, init=0xA), Var("B", 4, init=0xB)
    return [
        litmus("overlap-3",
               "two ranks put 4 bytes each into 8, overlapping by 2: only the overlap may "
               "tear, bytes outside stay intact",
               [[a], [b], [Var("x", 8)]],
               [[Put("pa", "A", 2, "x", 0), Wait("pa")], [Put("pb", "B", 2, "x", 2), Wait("pb")],
                []],
               final=[(2, "x")]),
        litmus("overlap-2", "as overlap-3, both puts from one rank, not awaited between",
               [[a, b], [Var("x", 8)]],
               [[Put("pa", "A", 1, "x", 0), Put("pb", "B", 1, "x", 2), Wait("pa"), Wait("pb")],
                []],
               final=[(1, "x")]),
        litmus("overlap-self", "as overlap-2, into the rank's own memory",
               [[a, b, Var("x", 8)]],
               [[Put("pa", "A", 0, "x", 0), Put("pb", "B", 0, "x", 2), Wait("pa"),
                 Wait("pb")]],
               final=[(0, "x")]),
    ]


def races() -> list[Litmus]:
    """Exactly one terminal outcome when a timeout or a cancel races the transfer."""
    tests = []
    for loop in (False, True):
        dest = 0 if loop else 1
        send = Send("m", "v", dest, 1)
        for name, post, end, about in (
                ("timeout-recv", Recv("r", "b", 0, 1, timed=True), [Wait("r")],
                 "a receive's timeout races the message: it completes, or times out and "
                 "the message stays for a later receive"),
                ("cancel-recv", Recv("r", "b", 0, 1), [Cancel("r"), Wait("r")],
                 "a cancel races the message: the match wins, or the receive is cancelled "
                 "and the message stays")):
            if loop:  # posted, then the message sent to itself, then the race
                memory, programs = [[Var("v", init=4), Var("b")]], [[post, send, *end]]
            else:
                memory, programs = [[Var("v", init=4)], [Var("b")]], [[send], [post, *end]]
            tests.append(litmus(f"{name}{'-self' if loop else ''}", about, memory, programs,
                                final=[(dest, "b")]))
    tests.append(litmus(
        "timeout-send",
        "a send's timeout races its receive: a send that timed out may still arrive, "
        "never twice, never after a later message of its channel",
        [[Var("v1", init=1), Var("v2", init=2)], [Var("b")]],
        [[Send("m1", "v1", 1, 1, timed=True), Send("m2", "v2", 1, 1)],
         [Recv("r", "b", 0, 1), Wait("r"), Read("b", "x")]]))
    tests.append(litmus(
        "timeout-get",
        "a get's timeout races the read: after a timeout the buffer is never written",
        [[Var("d", 2)], [Var("x", 2, init=7)]],
        [[Get("g", "d", 1, "x", timed=True), Wait("g")], []], final=[(0, "d")]))
    tests.append(litmus(
        "truncate",
        "a message longer than the receive buffer fills it and fails TRUNCATED; nothing "
        "else is lost or left over",
        [[Var("v", 2, init=6)], [Var("b")]],
        [[Send("m", "v", 1, 1)], [Recv("r", "b", 0, 1), Wait("r")]], final=[(1, "b")]))
    return tests


def catalogue() -> list[Litmus]:
    """Every test, in the order the report lists them."""
    return [*get_then_write(), *put_then_reuse(), *send_then_reuse(), *message_passing(),
            *send_completion(), *put_get(), *write_after_write(), *two_gets(),
            *completion_scope(), *send_order(), *causality(), *write_before_issue(),
            *overlapping_puts(), *races()]
