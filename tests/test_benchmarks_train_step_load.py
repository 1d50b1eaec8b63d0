"""benchmarks/train_step_load.py: the alternating order and the table's arithmetic (the runs
themselves are the benchmark's, not a unit test's)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import train_step_load as tsl  # noqa: E402


def test_backends_alternate_which_runs_first():
    assert [tsl.order(r) for r in range(3)] == [("fcoll", "gloo"), ("gloo", "fcoll"),
                                                ("fcoll", "gloo")]


def test_row_is_the_median_over_rounds_and_the_ratio_is_gloo_over_fcoll():
    row = tsl.summarize(2, "ddp", {"fcoll": [100.0, 300.0, 200.0], "gloo": [500.0, 400.0, 450.0]},
                        (1.0, 3.5))
    assert (row["fcoll_ms"], row["gloo_ms"], row["gloo_over_fcoll"]) == (200.0, 450.0, 2.25)
    text = tsl.table([row])
    assert "200.0" in text and "450.0" in text and "2.25x" in text and "1.0 -> 3.5" in text
