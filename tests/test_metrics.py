"""Clustering accuracy on hand-computed cases; NMI/ARI wrappers; input checks."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

from dkicf.metrics import ari, clustering_accuracy, contingency_matrix, nmi


def test_accuracy_identical_partition_is_one():
    assert clustering_accuracy([0, 0, 1, 1, 2], [0, 0, 1, 1, 2]) == 1.0


def test_accuracy_is_invariant_to_permuted_cluster_names():
    y = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    permuted = [2, 2, 2, 0, 0, 1, 1, 1, 1]  # 0 -> 2, 1 -> 0, 2 -> 1
    assert clustering_accuracy(y, permuted) == 1.0
    # arbitrary label values, strings included
    assert clustering_accuracy(y, [7, 7, 7, -3, -3, 10, 10, 10, 10]) == 1.0
    assert clustering_accuracy(["a", "a", "b", "b"], ["x", "x", "y", "y"]) == 1.0


def test_accuracy_hand_computed_with_mistakes():
    # contingency (cluster x class): c0 -> {0: 3, 1: 1}, c1 -> {1: 2, 0: 0}, c2 -> {2: 2, 1: 1}
    y_true = [0, 0, 0, 1, 1, 1, 1, 2, 2]
    y_pred = [0, 0, 0, 0, 1, 1, 2, 2, 2]
    # best matching: c0->0 (3), c1->1 (2), c2->2 (2): 7 of 9
    assert clustering_accuracy(y_true, y_pred) == pytest.approx(7 / 9)


def test_accuracy_needs_the_global_matching_not_a_greedy_one():
    # cluster c0 holds 3 of class A and 2 of class B; cluster c1 holds 3 of class A only.
    # Greedy (largest cell first) takes c0->A (3) and then c1->B (0): 3/8.
    # Optimal: c1->A (3), c0->B (2): 5/8.
    y_true = ["A", "A", "A", "B", "B", "A", "A", "A"]
    y_pred = [0, 0, 0, 0, 0, 1, 1, 1]
    assert clustering_accuracy(y_true, y_pred) == pytest.approx(5 / 8)


def test_accuracy_more_clusters_than_classes_counts_unmatched_as_errors():
    y_true = [0, 0, 0, 0, 1, 1, 1, 1]
    y_pred = [0, 0, 1, 1, 2, 2, 2, 2]  # class 0 split in two clusters
    # c2->1 (4) and one of c0/c1 -> 0 (2); the other 2 points are errors
    assert clustering_accuracy(y_true, y_pred) == pytest.approx(6 / 8)


def test_accuracy_fewer_clusters_than_classes():
    y_true = [0, 0, 1, 1, 2, 2]
    y_pred = [0, 0, 0, 0, 1, 1]  # classes 0 and 1 merged
    assert clustering_accuracy(y_true, y_pred) == pytest.approx(4 / 6)


def test_accuracy_single_cluster_is_the_majority_fraction():
    y_true = [0, 1, 1, 2, 2, 2]
    assert clustering_accuracy(y_true, np.zeros(6, dtype=int)) == pytest.approx(3 / 6)


def test_contingency_matrix_rows_are_clusters_in_sorted_order():
    C = contingency_matrix([0, 0, 1, 1], [5, 5, 5, 7])
    np.testing.assert_array_equal(C, [[2, 1], [0, 1]])
    assert C.dtype == np.int64


def test_nmi_and_ari_match_scikit_learn():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 4, 200)
    b = rng.integers(0, 3, 200)
    assert nmi(a, b) == pytest.approx(normalized_mutual_info_score(a, b))
    assert nmi(a, b, average_method="geometric") == pytest.approx(
        normalized_mutual_info_score(a, b, average_method="geometric")
    )
    assert ari(a, b) == pytest.approx(adjusted_rand_score(a, b))
    assert nmi(a, a) == pytest.approx(1.0)
    assert ari(a, (a + 1) % 4) == pytest.approx(1.0)


@pytest.mark.parametrize("func", [clustering_accuracy, nmi, ari])
def test_length_mismatch_names_both_lengths(func):
    with pytest.raises(ValueError, match="y_true has 3 labels but y_pred has 2"):
        func([0, 1, 1], [0, 1])


@pytest.mark.parametrize("func", [clustering_accuracy, nmi, ari])
def test_empty_input_is_refused(func):
    with pytest.raises(ValueError, match="y_true is empty"):
        func([], [])


@pytest.mark.parametrize("func", [clustering_accuracy, nmi, ari])
def test_two_dimensional_input_is_refused(func):
    with pytest.raises(ValueError, match=r"y_pred must be a 1-D array.*shape \(3, 1\).*ravel"):
        func([0, 1, 1], [[0], [1], [1]])
    with pytest.raises(ValueError, match="y_true must be a 1-D array"):
        func(np.zeros((2, 2)), [0, 1, 1, 0])


def test_nan_labels_are_refused():
    with pytest.raises(ValueError, match="y_pred contains NaN or infinity at position 1"):
        clustering_accuracy([0, 1], [0.0, np.nan])
