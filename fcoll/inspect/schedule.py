"""Moved to :mod:`fcoll.inspect.predicted`; kept until ``fcoll.inspect.artifacts`` imports it
from there."""

from fcoll.inspect.predicted import PredictFn, predicted_events  # noqa: F401
