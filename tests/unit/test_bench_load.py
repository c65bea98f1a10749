"""`streamq bench`'s pure parts: the arrival process, goodput's targets and which requests meet
them, and the percentiles reported."""
from __future__ import annotations

import statistics

import pytest

from streamq.bench import Result, arrival_gaps, meets, parse_goodput, summarise


def test_poisson_gaps_average_one_over_the_rate_and_repeat_by_seed():
    gaps = arrival_gaps(4.0, 1.0, 4000, seed=1)
    assert gaps == arrival_gaps(4.0, 1.0, 4000, seed=1) != arrival_gaps(4.0, 1.0, 4000, seed=2)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: sd = mean


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    bursty, even = arrival_gaps(4.0, 0.25, 4000, seed=3), arrival_gaps(4.0, 4.0, 4000, seed=3)
    assert statistics.fmean(bursty) == pytest.approx(0.25, rel=0.1)
    assert statistics.fmean(even) == pytest.approx(0.25, rel=0.05)
    # gamma with shape k: coefficient of variation 1/sqrt(k)
    assert statistics.stdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.15)
    assert statistics.stdev(even) / statistics.fmean(even) == pytest.approx(0.5, rel=0.1)


def test_all_at_once_without_a_rate():
    assert arrival_gaps(float("inf"), 1.0, 3, seed=0) == [0.0, 0.0, 0.0]


def test_goodput_targets_are_parsed_in_ms():
    assert parse_goodput(["ttft:500", "tpot:150", "e2el:20000"]) == {"ttft": 0.5, "tpot": 0.15, "e2el": 20.0}
    for bad in ["ttft", "itl:5", "ttft:fast", "tpot:0", "tpot:-3"]:
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput([bad])


def request(ttft: float, gap: float, tokens: int, ok: bool = True) -> Result:
    times = [ttft + i * gap for i in range(tokens)]
    return Result(ok=ok, start=0.0, token_times=times, output_tokens=tokens, received_tokens=tokens,
                  end=times[-1] if times else ttft)


def test_a_request_counts_only_within_every_target():
    slo = {"ttft": 0.5, "tpot": 0.1}
    assert meets(request(0.4, 0.1, 5), slo)
    assert not meets(request(0.6, 0.05, 5), slo)  # first token late
    assert not meets(request(0.1, 0.2, 5), slo)  # tokens too slow
    assert meets(request(0.4, 0.0, 1), slo)  # one token: no TPOT to miss
    assert not meets(request(0.1, 0.01, 5, ok=False), slo)  # failed


def test_summary_reports_p90_and_goodput():
    results = [request(0.1 * i, 0.05, 4) for i in range(1, 11)]  # TTFT 100 .. 1000 ms
    report = summarise(results, wall=10.0, slo={"ttft": 0.55})
    # interpolated between ranks, as numpy.percentile: 550, 910, 991
    assert report["ttft_ms"]["p50"] == pytest.approx(550.0) and report["ttft_ms"]["p90"] == pytest.approx(910.0)
    assert report["ttft_ms"]["p99"] == pytest.approx(991.0)
    assert report["goodput"] == {"slo_ms": {"ttft": 550.0}, "requests_met": 5, "requests_per_s": 0.5}
    assert "goodput" not in summarise(results, wall=10.0)
