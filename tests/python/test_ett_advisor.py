"""ettkit.ett.recommend_interval against Daly's published table (Daly 2006, Figs. 3-5; docs/ett.md)."""

import math

import pytest

from ettkit import ett

DALY = [  # M (min), young, daly first order, daly series, daly exact; delta = 5 min, R = 10 min
    (1440, 120.000, 120.416, 116.690, 116.690),
    (360, 60.000, 60.828, 56.713, 56.714),
    (15, 12.247, 15.811, 9.141, 9.167),
]


@pytest.mark.parametrize("m,young,daly,series,exact", DALY)
def test_daly_table(m, young, daly, series, exact):
    assert ett.recommend_interval(5, m) == pytest.approx(young, abs=1e-3)
    assert ett.recommend_interval(5, m, 10, method="daly") == pytest.approx(daly, abs=1e-3)
    assert ett.recommend_interval(5, m, 10, method="daly_series") == pytest.approx(series, abs=1e-3)
    assert ett.recommend_interval(5, m, 10, method="daly_exact") == pytest.approx(exact, abs=1e-3)


def test_returns_float_and_paper_rounding():
    v = ett.recommend_interval(5.0, 1440.0, 10.0, method="daly_series")
    assert isinstance(v, float) and round(v) == 117


@pytest.mark.parametrize("args", [(0, 10), (-1, 10), (math.nan, 10), (1, math.inf), (1, 0), (1, 10, -1),
                                  (1, 10, math.nan), ("x", 10)])
def test_bad_inputs_raise_value_error(args):
    with pytest.raises(ValueError):
        ett.recommend_interval(*args)


def test_unknown_method():
    with pytest.raises(ValueError, match="method='optimal'"):
        ett.recommend_interval(1, 10, method="optimal")
