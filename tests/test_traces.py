"""The shared trace loader and scaler (`rose.traces`) against the traces' documented statistics."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rose.traces import DAY_S, Diurnal, day_arrivals, densest, diurnal_for_peak, gamma_trace, load_trace


@pytest.mark.parametrize(("name", "rate", "cv", "peak1", "prompt_mean", "output_mean"), [
    # From /work/shared/traces/README.md (measured statistics).
    ("azure-conv", 5.53, 1.09, 2.9, 1155, 211),
    ("azure-code", 2.57, 13.2, 26, 2048, 28),
    ("mooncake", 3.40, 3.03, 8.2, 12035, 343),
])
def test_shipped_traces_match_their_documented_statistics(name, rate, cv, peak1, prompt_mean,
                                                          output_mean):
    s = load_trace(name).stats()
    assert s.mean_rate == pytest.approx(rate, rel=0.01)
    assert s.interarrival_cv == pytest.approx(cv, rel=0.02)
    assert s.peak_to_mean_1s == pytest.approx(peak1, rel=0.03)
    assert s.prompt_mean == pytest.approx(prompt_mean, rel=0.01)
    assert s.output_mean == pytest.approx(output_mean, rel=0.01)


def test_azure_conv_percentiles():
    s = load_trace("azure-conv").stats()
    assert (s.prompt_p50, s.output_p50) == (1020, 129)
    assert s.prompt_p99 == pytest.approx(4142, rel=0.01)
    assert s.output_p99 == pytest.approx(601, rel=0.01)


def test_rate_scaling_keeps_burst_shape_and_token_scaling_rounds():
    tr = load_trace("azure-conv")
    fast = tr.scaled(rate=20.0 / tr.mean_rate)
    assert fast.mean_rate == pytest.approx(20.0)
    assert fast.stats().interarrival_cv == pytest.approx(tr.stats().interarrival_cv, rel=1e-9)
    half = tr.scaled(tokens=0.5, output_tokens=2.0)
    assert half.prompt_tokens.min() >= 1
    assert half.prompt_tokens.mean() == pytest.approx(tr.prompt_tokens.mean() / 2, rel=0.01)
    assert half.output_tokens.mean() == pytest.approx(tr.output_tokens.mean() * 2, rel=0.01)
    with pytest.raises(ValueError, match="rate must be a positive number"):
        tr.scaled(rate=0)


def test_window_tiles_past_the_end_at_the_mean_rate():
    tr = load_trace("azure-code")
    w = tr.window(tr.period_s - 100.0, 3 * tr.period_s)
    assert w.arrival_s[0] >= 0 and w.arrival_s[-1] < 3 * tr.period_s
    assert len(w) / (3 * tr.period_s) == pytest.approx(tr.mean_rate, rel=0.02)


def test_a_window_with_too_few_requests_says_how_long_it_must_be():
    quiet = load_trace("azure-conv").scaled(rate=0.05)
    with pytest.raises(ValueError, match=r"30 s window from 0 s holds 1 request.*--duration (\d+)") as err:
        quiet.window(0.0, 30.0)
    needed = int(re.search(r"--duration (\d+)", str(err.value))[1])
    assert len(quiet.window(0.0, needed)) == 2 and "--load" in str(err.value)


def test_unknown_trace_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="expected one of azure-conv"):
        load_trace("nope")


def test_gamma_trace_rate_and_cv():
    tr = gamma_trace(rate=10.0, cv=2.0, duration_s=2000.0, lengths=load_trace("azure-conv"), seed=1)
    s = tr.stats()
    assert s.mean_rate == pytest.approx(10.0, rel=0.1)
    assert s.interarrival_cv == pytest.approx(2.0, rel=0.1)


def test_day_follows_the_diurnal_curve_and_mean():
    tr = load_trace("azure-conv")
    d = Diurnal(amplitude=0.5, peak_hour=14.0)
    assert d.multiplier(14 * 3600.0) == pytest.approx(1.5) and d.multiplier(2 * 3600.0) == pytest.approx(0.5)
    t, p, o = day_arrivals(tr, 8.0, d, 0.0, DAY_S, phase_s=123.0)
    assert len(t) == len(p) == len(o)
    assert np.all(np.diff(t) >= 0)
    assert len(t) / DAY_S == pytest.approx(8.0, rel=0.02)
    hourly = np.bincount((t // 3600).astype(int), minlength=24) / 3600
    assert hourly[14] / hourly[2] == pytest.approx(1.5 / 0.5, rel=0.15)
    # A window is the same stream as the whole day cut to it.
    tw, _, _ = day_arrivals(tr, 8.0, d, 3600.0, 7200.0, phase_s=123.0)
    assert np.allclose(tw, t[(t >= 3600) & (t < 7200)])


def test_diurnal_amplitude_reaches_the_papers_per_minute_peak():
    d = diurnal_for_peak("azure-conv", 1.7)
    assert 0 < d.amplitude < 0.5
    t, _, _ = day_arrivals(load_trace("azure-conv"), 5.53, d, 0.0, DAY_S)
    counts = np.bincount((t // 60).astype(int), minlength=1440)
    assert counts.max() / counts.mean() == pytest.approx(1.7, abs=0.02)


def test_densest_stretch_holds_the_most_weight() -> None:
    at = np.array([0.0, 1.0, 2.0, 10.0, 10.5, 11.0, 30.0])
    weight = np.array([5.0, 5.0, 5.0, 4.0, 4.0, 4.0, 20.0])
    assert densest(at, weight, 3.0) == (30.0, 20.0)
    assert densest(at, np.ones(7), 3.0) == (0.0, 3.0)  # the first of equals
    assert densest(at, np.ones(7), 1.01) == (10.0, 3.0)
