"""MPI-style matching tables: PostedReceives and UnexpectedMessages (thesis §5.3.1).

A match is always the oldest eligible entry, whatever bucket it sits in;
within one (source, tag) bucket entries leave in FIFO order; a cancel removes
one entry by identity; empty buckets do not linger. The property test checks
all of it against the obvious model: one list, scanned from the front.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mate.constants import ANY_SOURCE, ANY_TAG
from mate.matching import PostedReceives, UnexpectedMessages

ANY = ANY_SOURCE
assert ANY_TAG == ANY


class Item:
    """A distinct object per entry (tables compare by identity)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:  # equal by name, to catch `==` instead of `is`
        return isinstance(other, Item) and other.name == self.name

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"Item({self.name!r})"


def no_empty_buckets(table: PostedReceives[Item] | UnexpectedMessages[Item]) -> bool:
    return all(len(bucket) > 0 for bucket in table._buckets.values())


# -- PostedReceives: receives may use wildcards, messages are concrete ------------------


def test_posted_exact_match() -> None:
    posted: PostedReceives[Item] = PostedReceives()
    r = Item("r")
    posted.add(0, 5, r)
    assert posted.match(1, 5) is None
    assert posted.match(0, 6) is None
    assert posted.match(0, 5) is r
    assert posted.match(0, 5) is None
    assert len(posted) == 0 and posted._buckets == {}


def test_posted_wildcards() -> None:
    posted: PostedReceives[Item] = PostedReceives()
    any_source, any_tag, anything = Item("any_source"), Item("any_tag"), Item("anything")
    posted.add(ANY, 5, any_source)
    posted.add(2, ANY, any_tag)
    posted.add(ANY, ANY, anything)
    assert posted.match(1, 4) is anything  # only the full wildcard accepts it
    assert posted.match(1, 4) is None
    assert posted.match(2, 4) is any_tag
    assert posted.match(2, 4) is None
    assert posted.match(7, 5) is any_source
    assert len(posted) == 0 and posted._buckets == {}


def test_posted_oldest_eligible_across_buckets() -> None:
    posted: PostedReceives[Item] = PostedReceives()
    a, b, c, d = Item("a"), Item("b"), Item("c"), Item("d")
    posted.add(0, 1, a)  # bucket (0, 1)
    posted.add(ANY, ANY, b)
    posted.add(ANY, 1, c)
    posted.add(0, ANY, d)
    assert [posted.match(0, 1) for _ in range(5)] == [a, b, c, d, None]

    posted.add(ANY, ANY, b)  # now the wildcard is the oldest
    posted.add(0, 1, a)
    assert posted.match(0, 1) is b
    assert posted.match(0, 1) is a


def test_posted_fifo_within_bucket() -> None:
    posted: PostedReceives[Item] = PostedReceives()
    items = [Item(str(i)) for i in range(5)]
    for item in items:
        posted.add(ANY, 3, item)
    assert [posted.match(i, 3) for i in range(5)] == items


def test_posted_remove() -> None:
    posted: PostedReceives[Item] = PostedReceives()
    first, twin = Item("x"), Item("x")  # equal, not identical
    posted.add(ANY, 3, first)
    posted.add(ANY, 3, twin)
    assert posted.remove(ANY, 4, twin) is False  # wrong bucket
    assert posted.remove(ANY, 3, Item("x")) is False  # equal is not enough
    assert posted.remove(ANY, 3, twin) is True
    assert posted.remove(ANY, 3, twin) is False  # gone already
    assert posted.items() == [first] and posted.items()[0] is first
    assert posted.remove(ANY, 3, first) is True
    assert posted._buckets == {} and len(posted) == 0
    assert posted.match(0, 3) is None


def test_remove_then_match_keeps_order() -> None:
    posted: PostedReceives[Item] = PostedReceives()
    a, b, c = Item("a"), Item("b"), Item("c")
    posted.add(1, 2, a)
    posted.add(1, 2, b)
    posted.add(1, 2, c)
    assert posted.remove(1, 2, b)
    assert posted.match(1, 2) is a
    assert posted.match(1, 2) is c


def test_items_len_clear() -> None:
    posted: PostedReceives[Item] = PostedReceives()
    items = [Item(str(i)) for i in range(4)]
    for i, item in enumerate(items):
        posted.add(i % 2, ANY, item)
    assert len(posted) == 4
    assert sorted(x.name for x in posted.items()) == ["0", "1", "2", "3"]
    posted.clear()
    assert len(posted) == 0 and posted.items() == [] and posted.match(0, 0) is None


# -- UnexpectedMessages: messages are concrete, receives may use wildcards --------------


def test_unexpected_exact_match_ignores_other_buckets() -> None:
    unexpected: UnexpectedMessages[Item] = UnexpectedMessages()
    old, new = Item("old"), Item("new")
    unexpected.add(1, 9, old)
    unexpected.add(0, 5, new)
    assert unexpected.match(0, 5) is new
    assert unexpected.match(0, 5) is None
    assert unexpected.match(1, 8) is None
    assert unexpected.match(2, 9) is None
    assert unexpected.match(1, 9) is old
    assert unexpected._buckets == {}


def test_unexpected_wildcards_take_the_oldest_eligible() -> None:
    unexpected: UnexpectedMessages[Item] = UnexpectedMessages()
    m = [Item(f"m{i}") for i in range(6)]
    unexpected.add(2, 7, m[0])
    unexpected.add(1, 5, m[1])
    unexpected.add(0, 5, m[2])
    unexpected.add(1, 7, m[3])
    unexpected.add(0, 7, m[4])
    unexpected.add(1, 5, m[5])
    assert unexpected.match(ANY, 5) is m[1]
    assert unexpected.match(0, ANY) is m[2]
    assert unexpected.match(1, ANY) is m[3]
    assert unexpected.match(ANY, ANY) is m[0]
    assert unexpected.match(ANY, 9) is None
    assert unexpected.match(3, ANY) is None
    assert unexpected.match(ANY, ANY) is m[4]
    assert unexpected.match(ANY, ANY) is m[5]
    assert unexpected.match(ANY, ANY) is None
    assert unexpected._buckets == {} and len(unexpected) == 0


def test_unexpected_fifo_within_bucket() -> None:
    unexpected: UnexpectedMessages[Item] = UnexpectedMessages()
    items = [Item(str(i)) for i in range(5)]
    for item in items:
        unexpected.add(1, 1, item)
    got = [unexpected.match(1, 1), unexpected.match(ANY, 1), unexpected.match(1, ANY),
           unexpected.match(ANY, ANY), unexpected.match(1, 1), unexpected.match(1, 1)]
    assert got == [*items, None]


def test_unexpected_remove_cleans_bucket() -> None:
    unexpected: UnexpectedMessages[Item] = UnexpectedMessages()
    a, b = Item("a"), Item("b")
    unexpected.add(0, 1, a)
    unexpected.add(0, 2, b)
    assert unexpected.remove(0, 1, a)
    assert (0, 1) not in unexpected._buckets
    assert unexpected.remove(0, 1, a) is False
    assert unexpected.match(ANY, ANY) is b
    assert unexpected._buckets == {}


# -- against a naive model ------------------------------------------------------------

SOURCES = [0, 1, 2]
TAGS = [0, 1, 2]

add_op = st.tuples(st.just("add"), st.sampled_from([*SOURCES, ANY]), st.sampled_from([*TAGS, ANY]))
match_op = st.tuples(st.just("match"), st.sampled_from([*SOURCES, ANY]),
                     st.sampled_from([*TAGS, ANY]))
remove_op = st.tuples(st.just("remove"), st.integers(0, 10**6), st.booleans())
ops = st.lists(st.one_of(add_op, add_op, match_op, remove_op), max_size=60)


def accepts(want_source: int, want_tag: int, source: int, tag: int) -> bool:
    return want_source in (ANY, source) and want_tag in (ANY, tag)


def run_against_model(table: PostedReceives[Item] | UnexpectedMessages[Item],
                      posted: bool, script: list[tuple[str, int, int | bool]]) -> None:
    model: list[tuple[int, int, Item]] = []  # oldest first
    added: list[tuple[int, int, Item]] = []
    for n, (op, x, y) in enumerate(script):
        if op == "add":
            source, tag = x, int(y)
            if not posted:  # an unexpected message is concrete
                source, tag = max(source, 0), max(tag, 0)
            entry = (source, tag, Item(str(n)))
            table.add(*entry)
            model.append(entry)
            added.append(entry)
        elif op == "match":
            source, tag = x, int(y)
            if posted:  # a message is concrete; the receives hold the wildcards
                source, tag = max(source, 0), max(tag, 0)
                expected = next((e for e in model if accepts(e[0], e[1], source, tag)), None)
            else:
                expected = next((e for e in model if accepts(source, tag, e[0], e[1])), None)
            got = table.match(source, tag)
            if expected is None:
                assert got is None
            else:
                assert got is expected[2]
                model.remove(expected)
        elif added:
            source, tag, item = added[x % len(added)]
            if y:  # sometimes ask in the wrong bucket: must not remove
                assert table.remove(source, (tag + 1) % 3, item) is False
            present = any(e[2] is item for e in model)
            assert table.remove(source, tag, item) is present
            model = [e for e in model if e[2] is not item]
        assert len(table) == len(model)
        assert {id(i) for i in table.items()} == {id(e[2]) for e in model}
        assert no_empty_buckets(table)


@settings(max_examples=200, deadline=None)
@given(script=ops)
def test_posted_receives_match_the_model(script: list[tuple[str, int, int | bool]]) -> None:
    run_against_model(PostedReceives(), True, script)


@settings(max_examples=200, deadline=None)
@given(script=ops)
def test_unexpected_messages_match_the_model(script: list[tuple[str, int, int | bool]]) -> None:
    run_against_model(UnexpectedMessages(), False, script)
