"""Litmus tests for mate's semantics (SPEC §1-§2, §8), in the manner of coreRMA (seed 000).

A small language for programs of a few ranks (`mate.litmus.language`), a
model that enumerates the outcomes the spec allows for each
(`mate.litmus.model`), the tests (`mate.litmus.catalogue`), a runner that
runs them many times on a transport with random delays and counts what it
observes (`mate.litmus.runner`), and the report (`mate.litmus.report`).
``python -m mate.litmus --transport T`` runs them all.
"""
