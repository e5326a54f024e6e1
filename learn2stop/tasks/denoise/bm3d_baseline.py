"""BM3D (Dabov et al. 2007) with the true noise level, through the optional ``bm3d`` package."""
from __future__ import annotations

import numpy as np


def bm3d_available() -> bool:
    """True if the optional ``bm3d`` package imports (``pip install bm3d``)."""
    try:
        import bm3d  # noqa: F401
    except Exception:  # an ImportError, or a broken binary dependency
        return False
    return True


def bm3d_denoise(noisy: np.ndarray, sigma: float) -> np.ndarray:
    """Denoise a (H, W) image in [0, 1]-ish given the noise std ``sigma`` on the 0..255 scale.

    Raises:
        ImportError: with the install command, if ``bm3d`` is absent.
    """
    try:
        import bm3d
    except ImportError:
        raise ImportError("BM3D needs the optional package 'bm3d' (pip install bm3d)") from None
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0; got {sigma}")
    if sigma == 0:
        return np.asarray(noisy, dtype=np.float32)
    out = bm3d.bm3d(np.asarray(noisy, dtype=np.float64), sigma_psd=sigma / 255.0)
    return np.asarray(out, dtype=np.float32)
