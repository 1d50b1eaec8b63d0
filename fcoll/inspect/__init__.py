"""Inspection tools for fcoll graphs: stable text, tables, reports, timelines and traces."""

from fcoll.inspect.format import format_graph, stable_names

__all__ = ["format_graph", "stable_names"]
