"""fcoll.sim: what a compiled step would cost on other world sizes and clusters.

- :func:`simulate`: step time, communication, exposed communication and peak memory per
  layout, from the graphs ``fcoll.inspect`` wrote (``*.schedule.json``) or live graphs.
- :func:`parse_link`: ``'shm'`` or ``'100gbit,5us'``; :class:`Layout`: ranks and ranks per host.
- :mod:`fcoll.sim.algorithms`: ring, tree and hierarchical collective times (alpha-beta).
- ``python -m fcoll.sim DIR --ranks 2,4,64,4096 --hosts-of 8 --intra shm --inter 100gbit,5us``.

Layering: the top of fcoll (it reads ``fcoll.inspect``'s files and may use every layer below).
"""

from fcoll.sim.algorithms import flat_us, hierarchical_us
from fcoll.sim.links import Link, MeasuredLink, parse_link, shm_time_us
from fcoll.sim.program import Program, load_programs
from fcoll.sim.replay import Replay, replay
from fcoll.sim.report import plot_svg, report_text
from fcoll.sim.scaling import ASSUMPTIONS, Layout, layouts, shard_names
from fcoll.sim.simulate import (
    ALGORITHM_CHOICES, GraphResult, LayoutResult, Network, SimReport, collective_us, simulate,
)

__all__ = [
    "simulate", "SimReport", "LayoutResult", "GraphResult", "Network", "collective_us",
    "ALGORITHM_CHOICES", "Layout", "layouts", "shard_names", "ASSUMPTIONS", "Link",
    "MeasuredLink", "parse_link", "shm_time_us", "flat_us", "hierarchical_us", "Program",
    "load_programs", "Replay", "replay", "report_text", "plot_svg",
]
