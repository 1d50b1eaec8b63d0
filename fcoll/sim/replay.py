"""Replay one program on two kinds of stream: compute, and one communication stream per group.

Rules (the executor's, :mod:`fcoll.compile.executor`): nodes are issued in graph order by
one compute stream. A compute node runs when the compute stream reaches it. A collective is
issued when the compute stream reaches it (its inputs were computed before it) and starts when
its group's communication stream is free, then occupies that stream for its duration. A wait
blocks the compute stream until its collective ends; the time blocked is exposed
communication. The graph ends when compute and every stream are done.

These are the passes' rules too: the clock is :class:`fcoll.passes.analysis.lanes.LaneClock`,
the one the overlap scheduler and ``fcoll.inspect`` predict with. What differs is the input: a
recorded program must issue each collective before its wait (a wait before it raises here,
where the passes' :class:`~fcoll.passes.analysis.lanes.Timeline` counts it as not blocking),
and the replay adds memory.

Memory follows the storage model written into the schedule (:mod:`fcoll.inspect.schedule`):
inputs are live throughout; a node's allocation is live from the node until the node that
frees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fcoll.passes.analysis.lanes import LaneClock
from fcoll.sim.program import Node, Program

__all__ = ["Replay", "replay"]


@dataclass(frozen=True)
class Replay:
    """What one program costs (microseconds and bytes, one rank).

    Attributes:
        step_us: when the last compute or communication ends.
        compute_us: the compute stream's busy time.
        comm_us: the sum of collective durations.
        exposed_comm_us: compute time blocked in waits.
        peak_bytes: the largest live bytes, inputs included.
        input_bytes: the program's inputs (placeholders).
    """

    step_us: float
    compute_us: float
    comm_us: float
    exposed_comm_us: float
    peak_bytes: float
    input_bytes: float

    @property
    def hidden_comm_us(self) -> float:
        return max(0.0, self.comm_us - self.exposed_comm_us)


def replay(program: Program, duration: Callable[[Node], float],
           alloc: Callable[[Node], float]) -> Replay:
    """Replay ``program`` (module docstring rules).

    Args:
        program: the graph's nodes in execution order.
        duration: node -> microseconds (compute and collectives; waits and placeholders are
            not asked).
        alloc: node -> bytes it allocates (placeholders: their bytes).

    Raises:
        ValueError: a wait whose collective has not been issued before it.
    """
    clock = LaneClock()
    compute = comm = exposed = 0.0
    ends: dict[str, float] = {}
    sizes: dict[str, float] = {}
    live = inputs = peak = 0.0
    for n in program.nodes:
        if n.cls == "placeholder":
            inputs += alloc(n)
            continue
        if n.cls == "compute":
            d = max(0.0, duration(n))
            clock.compute(d)
            compute += d
        elif n.cls == "collective":
            d = max(0.0, duration(n))
            _, ends[n.name] = clock.issue(str(n.group), d)
            comm += d
        else:
            if n.collective not in ends:
                raise ValueError(f"{program.name}: wait {n.name} comes before its collective "
                                 f"{n.collective}")
            exposed += clock.wait(ends[n.collective])
        b = alloc(n)
        sizes[n.name] = b
        live += b
        peak = max(peak, live)
        for f in n.frees:
            live -= sizes.get(f, 0.0)
    return Replay(clock.end_us, compute, comm, exposed, inputs + peak, inputs)
