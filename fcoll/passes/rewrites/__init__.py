"""The passes: graph rewrites (lowering, bucketing, overlap scheduling) and the rank check.

Each module defines one or more :class:`~fcoll.passes.registry.FcollPass` and registers it on
import; the pass order is :mod:`fcoll.passes.config`'s. Decisions read
:mod:`fcoll.passes.analysis`; rewrites never happen there.
"""
