"""tools/benchmarks/stats.py: the permutation test that says whether a missed median is noise."""

import pytest

from tools.benchmarks.stats import worse_by_chance


def test_runs_from_one_distribution_are_worse_by_chance_often():
    runs = [2676.0, 2527.0, 2288.0, 2305.0, 2578.0, 2400.0]
    assert worse_by_chance(runs[:3], runs[3:]) == pytest.approx(0.5)


def test_separated_runs_are_rarely_worse_by_chance_and_the_direction_counts():
    slow, fast = [10.0, 11, 12, 13, 14, 15], [1.0, 2, 3, 4, 5, 6]
    assert worse_by_chance(slow, fast, "lower") < 0.01
    assert worse_by_chance(fast, slow, "lower") == 1.0
    assert worse_by_chance(fast, slow, "higher") < 0.01  # a throughput: fewer is worse


def test_too_few_runs_say_nothing_and_many_runs_are_sampled():
    assert worse_by_chance([1.0], [2.0, 3.0]) is None
    many = worse_by_chance([float(x) for x in range(20, 40)], [float(x) for x in range(20)])
    assert many is not None and many < 0.001
