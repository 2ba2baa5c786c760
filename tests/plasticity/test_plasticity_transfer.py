"""Continual-learning metrics and the regret-utility bootstrap, against hand-computed numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nested.plasticity import regret, transfer

# R[i, j]: metric on task j after phase i; b: metric before any phase.
R = [[0.9, 0.1, 0.2], [0.5, 0.8, 0.3], [0.4, 0.6, 0.7]]
B = [0.1, 0.15, 0.2]
# Z[k, b]: metric on task k after b minibatches of its own phase.
Z = [[0.1, 0.4, 0.7], [0.3, 0.5, 0.9]]


def test_metrics_by_hand():
    np.testing.assert_allclose(transfer.average_accuracy(R), (0.4 + 0.6 + 0.7) / 3)
    np.testing.assert_allclose(transfer.backward_transfer(R), ((0.4 - 0.9) + (0.6 - 0.8)) / 2)
    np.testing.assert_allclose(transfer.backward_transfer(R), -0.35)
    np.testing.assert_allclose(transfer.forward_transfer(R, B), ((0.1 - 0.15) + (0.3 - 0.2)) / 2)
    np.testing.assert_allclose(transfer.forward_transfer(R, B), 0.025)
    # f_0 = max(0.9, 0.5) - 0.4, f_1 = max(0.1, 0.8) - 0.6
    np.testing.assert_allclose(transfer.forgetting_max_per_task(R), [0.5, 0.2])
    np.testing.assert_allclose(transfer.forgetting_max(R), 0.35)
    np.testing.assert_allclose(transfer.forgetting_first_last_per_task(R), [0.9 - 0.4, 0.8 - 0.6])
    np.testing.assert_allclose(transfer.forgetting_first_last(R), 0.35)


def test_max_forgetting_differs_from_first_minus_last():
    # Task 0 peaks at 0.8 after task 1's phase, above its 0.5 right after its own phase.
    R2 = [[0.5, 0.1, 0.0], [0.8, 0.7, 0.2], [0.6, 0.5, 0.9]]
    np.testing.assert_allclose(transfer.forgetting_max_per_task(R2), [0.8 - 0.6, 0.7 - 0.5])
    np.testing.assert_allclose(transfer.forgetting_max(R2), 0.2)
    np.testing.assert_allclose(transfer.forgetting_first_last_per_task(R2), [0.5 - 0.6, 0.7 - 0.5])
    np.testing.assert_allclose(transfer.forgetting_first_last(R2), 0.05)


def test_max_forgetting_includes_phases_before_the_task():
    # Task 1 scores 0.9 at phase 0, before it is learned; the RWalk max counts that phase.
    R3 = [[0.2, 0.9, 0.0], [0.1, 0.6, 0.0], [0.1, 0.5, 0.4]]
    np.testing.assert_allclose(transfer.forgetting_max_per_task(R3), [0.2 - 0.1, 0.9 - 0.5])


def test_learning_curve_area():
    # Z_b = mean over tasks: Z_0 = 0.2, Z_1 = 0.45, Z_2 = 0.8.
    np.testing.assert_allclose(transfer.learning_curve_area(Z, 0), 0.2)
    np.testing.assert_allclose(transfer.learning_curve_area(Z, 1), (0.2 + 0.45) / 2)
    np.testing.assert_allclose(transfer.learning_curve_area(Z, 2), (0.2 + 0.45 + 0.8) / 3)


def test_summary():
    out = transfer.summary(R, b=B, curves=Z)
    assert set(out) == {
        "average_accuracy",
        "backward_transfer",
        "forward_transfer",
        "forgetting_max",
        "forgetting_first_last",
        "learning_curve_area",
    }
    assert all(type(v) is float for v in out.values())
    np.testing.assert_allclose(out["backward_transfer"], -0.35)
    np.testing.assert_allclose(out["forward_transfer"], 0.025)
    np.testing.assert_allclose(out["learning_curve_area"], (0.2 + 0.45 + 0.8) / 3)
    np.testing.assert_allclose(transfer.summary(R, curves=Z, beta=1)["learning_curve_area"], 0.325)
    assert set(transfer.summary(R)) == {
        "average_accuracy",
        "backward_transfer",
        "forgetting_max",
        "forgetting_first_last",
    }


def test_single_task_is_nan_where_undefined():
    out = transfer.summary([[0.7]], b=[0.2])
    np.testing.assert_allclose(out["average_accuracy"], 0.7)
    for key in ("backward_transfer", "forward_transfer", "forgetting_max", "forgetting_first_last"):
        assert math.isnan(out[key]), key
    assert transfer.forgetting_max_per_task([[0.7]]).shape == (0,)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: transfer.check_matrix([[0.1, 0.2]]), "R"),
        (lambda: transfer.check_matrix(np.zeros((2, 2, 2)), name="acc"), "acc"),
        (lambda: transfer.average_accuracy(np.zeros((0, 0))), "R"),
        (lambda: transfer.backward_transfer([[0.1, np.nan], [0.2, 0.3]]), "R"),
        (lambda: transfer.average_accuracy([[0.1, np.inf], [0.2, 0.3]]), "R"),
        (lambda: transfer.forward_transfer(R, [0.1, 0.2]), "b"),
        (lambda: transfer.forward_transfer(R, [0.1, np.nan, 0.2]), "b"),
        (lambda: transfer.learning_curve_area(Z, 3), "beta"),
        (lambda: transfer.learning_curve_area(Z, -1), "beta"),
        (lambda: transfer.learning_curve_area([0.1, 0.2], 0), "Z"),
        (lambda: regret.bootstrap_ci(np.ones((1, 3))), "samples"),
        (lambda: regret.bootstrap_ci(np.ones(4), level=1.0), "level"),
        (lambda: regret.regret_utility(np.ones((1, 2)), np.ones((1, 3, 2))), "fresh"),
        (lambda: regret.regret_utility(np.ones((4, 2)), np.ones((4, 3, 5))), "primed"),
        (lambda: regret.regret_utility(np.ones((4, 2)), np.ones((4, 2))), "primed"),
    ],
)
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}: ") as info:
        call()
    assert "\n" not in str(info.value)


def test_bootstrap_ci_mean():
    x = np.array([1.0, 2.0, 4.0, 5.0, 8.0, 10.0])
    est, low, high = regret.bootstrap_ci(x)
    assert est == 5.0
    assert low < est < high
    assert low >= 1.0 and high <= 10.0
    assert regret.bootstrap_ci(x, seed=3) == regret.bootstrap_ci(x, seed=3)
    assert regret.bootstrap_ci(x, seed=3) != regret.bootstrap_ci(x, seed=4)
    # A wider level gives a wider interval, same resamples.
    _, low99, high99 = regret.bootstrap_ci(x, level=0.99)
    assert low99 <= low and high <= high99


def test_bootstrap_ci_constant():
    assert regret.bootstrap_ci(np.full(8, 0.25)) == (0.25, 0.25, 0.25)


def test_bootstrap_ci_trailing_dims_match_each_slice():
    x = np.random.default_rng(1).normal(size=(10, 2, 3))
    est, low, high = regret.bootstrap_ci(x, resamples=500, seed=7)
    assert est.shape == low.shape == high.shape == (2, 3)
    np.testing.assert_allclose(est, x.mean(axis=0))
    assert np.all(low < est) and np.all(est < high)
    # Same resample indices for every entry: vectorised equals slice by slice.
    for a in range(2):
        for c in range(3):
            ref = regret.bootstrap_ci(x[:, a, c], resamples=500, seed=7)
            np.testing.assert_allclose([est[a, c], low[a, c], high[a, c]], ref)
    moved = regret.bootstrap_ci(np.moveaxis(x, 0, 2), resamples=500, seed=7, axis=2)
    np.testing.assert_allclose(moved, (est, low, high))


def test_bootstrap_ci_statistic():
    x = np.array([1.0, 2.0, 3.0, 100.0])
    est, low, high = regret.bootstrap_ci(x, statistic=np.median)
    assert est == 2.5
    assert low <= est <= high


def test_regret_utility_zero_when_priming_changes_nothing():
    fresh = np.random.default_rng(2).uniform(5.0, 10.0, size=(6, 3))
    primed = np.broadcast_to(fresh[:, None, :], (6, 4, 3))
    out = regret.regret_utility(fresh, primed)
    assert out["sessions"] == 6
    for key in ("utility", "low", "high"):
        assert out[key].shape == (4, 3)
        assert np.all(out[key] == 0.0), key


def test_regret_utility_known_gain():
    # Priming on A lowers B's cumulative loss by gain[a, b], plus per-session noise of mean 0.
    gain = np.array([[1.0, 0.0, -0.5], [2.0, 0.25, 0.0]])
    noise = np.array([0.3, -0.3, 0.1, -0.1, 0.2, -0.2, 0.0, 0.0])
    fresh = np.random.default_rng(3).uniform(5.0, 10.0, size=(8, 3))
    primed = fresh[:, None, :] - gain - noise[:, None, None]
    out = regret.regret_utility(fresh, primed, resamples=1000, seed=1)
    assert out["sessions"] == 8
    np.testing.assert_allclose(out["utility"], gain, atol=1e-12)
    assert np.all(out["low"] < gain) and np.all(gain < out["high"])
    assert np.all(out["high"] - out["low"] <= 2 * 0.3)


def test_the_tracking_matrix_counts_the_keys_a_later_task_left_unchanged():
    """Two agents, three tasks of four keys: agent 0 changes key 0 then keys 1 and 2, agent 1
    changes key 3 then nothing; R[i, j] is the shared fraction of keys, averaged."""
    mappings = [
        [[10, 11, 12, 13], [20, 11, 12, 13], [20, 21, 22, 13]],
        [[10, 11, 12, 13], [10, 11, 12, 23], [10, 11, 12, 23]],
    ]
    R = transfer.tracking_matrix(mappings)
    expected = np.array(
        [
            [1.0, (0.75 + 0.75) / 2, (0.25 + 0.75) / 2],
            [0.75, 1.0, (0.5 + 1.0) / 2],
            [0.5, 0.75, 1.0],
        ]
    )
    np.testing.assert_allclose(R, expected)
    # its backward transfer is the forgetting the remapping forces
    assert transfer.backward_transfer(R) == pytest.approx(((0.5 - 1) + (0.75 - 1)) / 2)
    with pytest.raises(ValueError, match="agents, tasks, keys"):
        transfer.tracking_matrix([[1, 2], [3, 4]])
    # the keys named: the same keys in another order change nothing; keys of their own give
    # the identity, and a key two tasks share counts where its value agrees
    order = [[3, 2, 1, 0]] * 3
    reordered = np.asarray(mappings)[:, :, ::-1]
    np.testing.assert_allclose(transfer.tracking_matrix(reordered, order), expected)
    own = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    np.testing.assert_array_equal(transfer.tracking_matrix(mappings, own), np.eye(3))
    shared = [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    same = [[[10, 11, 12, 13], [13, 14, 15, 16], [26, 17, 18, 19]]]
    R = transfer.tracking_matrix(same, shared)
    np.testing.assert_allclose(R, [[1, 0.25, 0], [0.25, 1, 0], [0, 0, 1]])
    with pytest.raises(ValueError, match="keys: expected"):
        transfer.tracking_matrix(mappings, own[:2])


def test_agent_intervals_are_over_the_agents_with_a_finite_matrix():
    """Three agents' R (the third met no query of the kind: nan); the estimate is the mean
    of the first two agents' own BWT, inside its bootstrap interval."""
    R0 = np.array([[1.0, 0.0], [0.5, 1.0]])
    R1 = np.array([[0.8, 0.0], [0.6, 0.9]])
    R2 = np.full((2, 2), np.nan)
    rows = np.stack([R0, R1, R2], axis=-1)
    intervals = transfer.agent_intervals(rows, np.zeros((2, 3)))
    mean, low, high = intervals["backward_transfer"]
    assert mean == pytest.approx(((0.5 - 1.0) + (0.6 - 0.8)) / 2)
    assert low <= mean <= high and low == pytest.approx(-0.5) and high == pytest.approx(-0.2)
    assert transfer.agent_intervals(rows[..., :1], np.zeros((2, 1))) == {}
