"""Read-only analysis of graphs: what the passes read to decide, never a rewrite.

- :mod:`~fcoll.passes.analysis.cost`: the cost model (roofline compute, communication curves).
- :mod:`~fcoll.passes.analysis.comm_cost`: the communication model, pure (alpha-beta curves).
- :mod:`~fcoll.passes.analysis.memory`: the storage model (live bytes, op classes).
- :mod:`~fcoll.passes.analysis.lanes`: the lane simulator (compute serial, one lane per group).
- :mod:`~fcoll.passes.analysis.fingerprints`: each group's collective sequence and its digest
  (what the rank check compares, what shared plans and call-site tags are keyed by).
- :mod:`~fcoll.passes.analysis.calibration`, :mod:`~fcoll.passes.analysis.calibration_probes`,
  :mod:`~fcoll.passes.analysis.calibration_cache`: measuring the model's numbers on real groups.

Imports only :mod:`fcoll.passes.graph` and the layers below, never
:mod:`fcoll.passes.rewrites`.
"""
