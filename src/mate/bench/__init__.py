"""mate-bench: the benchmarks of SPEC §5 (ping tests of thesis §6.2).

``mate-bench {pingpong,pingping,put,get,wait} [options]`` or
``python -m mate.bench ...``; ``python -m mate.bench.tcp`` is the asyncio TCP
loopback ping-pong with the same output. Modules:

* `stats`: the arithmetic (sizes, median, latency, bandwidth, CPU %, n½);
* `measure`: warm-up, adaptive iteration count, repetitions of one size;
* `patterns`: the patterns over mate's API and over raw mpi4py;
* `driver`: the sweep on the local or the MPI transport;
* `report`: the table, the JSON object of SPEC §5, the plot;
* `cli`: the command line; `tcp`: the TCP streams baseline.
"""

from mate.bench.cli import main

__all__ = ["main"]
