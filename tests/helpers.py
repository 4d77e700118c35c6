"""Small helpers shared by test modules (conftest.py files hold fixtures only: several share that module name)."""

import numpy as np


def relative_error(a, b) -> float:
    """||a - b|| / ||b||, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
