"""Spec §9 vectors shared by several test files (one table, one place)."""

# fedaware.md §9 A3, A4, A5 (origin in the hull), A7: rows M of the update matrix (G = M M^T) and the
# min-norm value q = lambda^T G lambda
MIN_NORM_CASES = [
    ([[1, 0, 0], [0, 2, 0], [0, 0, 3]], 36 / 49),
    ([[1, 0], [2, 1], [3, -1]], 1.0),
    ([[1, 0], [-1, 1], [-1, -1]], 0.0),
    ([[1.0, 0.2, 0.0], [0.3, 1.0, 0.1], [-0.2, 0.4, 1.0], [0.5, 0.5, 0.5]], 0.496423447934702),
]
