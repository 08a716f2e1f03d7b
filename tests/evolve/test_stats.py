from __future__ import annotations

import numpy as np
import pytest

from rtxops.evolve import stats


def noisy(rng, base, n, cv=0.05):
    return list(base * np.exp(rng.normal(0, cv, n)))


def test_identical_arms_never_promote_over_many_windows():
    """Noise alone (same distribution, fixed seed, many windows) never produces a promotion."""
    rng = np.random.default_rng(1234)
    promoted = 0
    for window in range(300):
        step_noise = rng.normal(0, 0.1, 20)  # both arms share each step's conditions
        inc = list(1000 * np.exp(step_noise + rng.normal(0, 0.05, 20)))
        cand = list(1000 * np.exp(step_noise + rng.normal(0, 0.05, 20)))
        promoted += stats.compare_paired(inc, cand, seed=window).promote
    assert promoted == 0


def test_a_clearly_faster_arm_is_promoted_with_a_positive_interval():
    rng = np.random.default_rng(7)
    inc = noisy(rng, 1000, 20)
    cand = [v * 0.8 for v in noisy(rng, 1000, 20, cv=0.02)]
    c = stats.compare_paired(inc, cand)
    assert c.promote, c.reason
    assert 0 < c.ci_low <= c.gain <= c.ci_high
    assert 0.1 < c.gain < 0.3
    assert c.p_value < 0.01


def test_a_slower_arm_is_never_promoted():
    rng = np.random.default_rng(3)
    inc = noisy(rng, 1000, 30)
    c = stats.compare_paired(inc, [3 * v for v in inc])
    assert not c.promote and c.gain < -1.5


def test_a_real_but_small_gain_is_below_the_minimum():
    inc = [1000.0 + i % 3 for i in range(40)]
    c = stats.compare_paired(inc, [v * 0.99 for v in inc], min_gain=0.03)
    assert not c.promote and "below the minimum" in c.reason


def test_too_few_samples_decide_nothing():
    c = stats.compare_paired([1.0, 1.0], [0.5, 0.5])
    assert not c.promote and "needed" in c.reason
    assert c.gain is None   # not a gain of 0 (stored and shown as "+0.0%")
    assert stats.compare_independent([1.0] * 3, [0.5] * 3).gain is None
    with pytest.raises(ValueError):
        stats.compare_paired([1.0], [1.0, 2.0])


def test_independent_comparison_sees_a_shift_and_not_noise():
    rng = np.random.default_rng(5)
    a = noisy(rng, 1000, 25)
    assert stats.compare_independent(a, noisy(rng, 700, 25)).promote
    same = stats.compare_independent(a, noisy(rng, 1000, 25))
    assert not same.promote and same.p_value > 0.01


def test_objective_combines_time_and_memory():
    assert stats.objective_value(50, 10, "time", 100, 20) == 50
    assert stats.objective_value(50, 10, "memory", 100, 20) == 10
    assert stats.objective_value(50, 10, "time+memory", 100, 20) == pytest.approx(1.0)
    assert stats.objective_value(50, None, "memory", 100, None) == 50  # not measured: time
    with pytest.raises(ValueError):
        stats.objective_value(1, 1, "speed", 1, 1)


def test_few_samples_promote_only_when_the_test_agrees():
    # five identical 10 % gains: the interval is a point, but five signs cannot reach p <= 1 %
    few = stats.compare_paired([1.0] * 5, [0.9] * 5)
    assert not few.promote and "not significant" in few.reason and few.p_value > 0.01
    many = stats.compare_paired([1.0] * 12, [0.9] * 12)
    assert many.promote and many.p_value <= 0.01
    # no real difference on small samples: at most about the test's 1 % promotes
    rng = np.random.default_rng(3)
    promoted = sum(stats.compare_paired(np.exp(rng.normal(0, 0.1, 6)), np.exp(rng.normal(0, 0.1, 6)),
                                        seed=i).promote for i in range(400))
    assert promoted <= 6


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_timings_that_are_not_finite_are_left_out(bad):
    fast = [1.0, 0.8, 0.81, 0.79, 0.8, 0.8, 0.82, 0.8, 0.8, 0.8, 0.79]
    for compare in (stats.compare_paired, stats.compare_independent):
        only_bad = compare([bad] * 8, [bad] * 8)
        assert not only_bad.promote and only_bad.samples == 0
        mixed = compare([1.0] * 11 + [bad], fast + [0.5])
        assert mixed.samples == 11 and mixed.promote, mixed.reason
        incumbent_bad = compare([bad] * 11, fast)
        assert not incumbent_bad.promote


def test_the_loop_refuses_an_objective_it_would_not_honour():
    """Its readings are times only: a decision recorded as on memory would have been on time."""
    from rtxops.evolve.config import LoopConfig

    LoopConfig(objective="time").check()
    for objective in ("memory", "time+memory", "speed"):
        with pytest.raises(ValueError, match="RTXOPS_EVOLVE_OBJECTIVE"):
            LoopConfig(objective=objective).check()


def test_a_misspelt_setting_is_refused_with_the_nearest_name(monkeypatch):
    """`RTXOPS_EVOLVE_WINDOW=abc` (the README once said "window") was silently ignored."""
    from rtxops.evolve.config import LoopConfig

    monkeypatch.setenv("RTXOPS_EVOLVE_WINDOW", "40")
    with pytest.raises(ValueError, match="did you mean RTXOPS_EVOLVE_WINDOW_STEPS"):
        LoopConfig.from_env()
    monkeypatch.delenv("RTXOPS_EVOLVE_WINDOW")
    monkeypatch.setenv("RTXOPS_EVOLVE_WINDOW_STEPS", "40")
    assert LoopConfig.from_env().window_steps == 40


@pytest.mark.parametrize("name, raw", [
    ("INTERVAL_S", "nan"),          # Event.wait(nan) returns at once: an idle daemon spun a core
    ("INTERVAL_S", "inf"),          # the loop's thread died on OverflowError, status said nothing
    ("MIN_GAIN", "nan"),
    ("MIN_STEPS", "-1"),
    ("MARGIN_STEPS", "-3"),
    ("GATE_TIMEOUT_S", "-5"),
    ("MIN_SHARE", "1.5"),
    ("DETERMINISTIC", "enabled"),   # read as false: non-deterministic variants stayed in
])
def test_an_evolve_setting_out_of_its_range_is_refused_with_its_name(monkeypatch, name, raw):
    from rtxops.evolve.config import LoopConfig

    monkeypatch.setenv(f"RTXOPS_EVOLVE_{name}", raw)
    with pytest.raises(ValueError, match=f"RTXOPS_EVOLVE_{name}"):
        LoopConfig.from_env()


def test_an_evolve_switch_takes_on_and_off(monkeypatch):
    from rtxops.evolve.config import LoopConfig

    for raw, want in (("on", True), ("Yes", True), ("1", True), ("off", False), ("0", False)):
        monkeypatch.setenv("RTXOPS_EVOLVE_DETERMINISTIC", raw)
        assert LoopConfig.from_env().deterministic is want
