"""Rotary position embedding parameters: per-pair inverse frequencies and the magnitude scale.

Backends apply them; this module only derives them from the config (base, scaling) and the optional
`rope_freqs` tensor (Llama 3.1 stores a per-pair divisor of the frequencies there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from infero.checkpoint.config import ModelConfig


@dataclass(frozen=True)
class Rotary:
    inv_freq: np.ndarray  # float64 [rope_dim // 2]: radians per position for each rotated pair
    pairing: str  # interleaved: pairs (2i, 2i+1); neox: pairs (i, i + rope_dim/2)
    rope_dim: int  # leading dimensions of each head that rotate; the rest pass through
    mscale: float  # multiplies cos and sin (YaRN's attention temperature)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float64 [n, rope_dim // 2] cos and sin of every position's angles, mscale applied."""
        angles = positions.astype(np.float64)[:, None] * self.inv_freq[None, :]
        return np.cos(angles) * self.mscale, np.sin(angles) * self.mscale


def build_rotary(config: ModelConfig, freq_factors: np.ndarray | None = None) -> Rotary:
    d = config.rope_dim
    pair = np.arange(0, d, 2, dtype=np.float64)
    inv_freq = config.rope_theta ** (-pair / d)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    scaling, mscale = config.rope_scaling, 1.0
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "yarn":
        inv_freq, mscale = _yarn(inv_freq, config)
    return Rotary(inv_freq=inv_freq, pairing=config.rope_pairing, rope_dim=d, mscale=mscale)


def _yarn(inv_freq: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023) as llama.cpp's rope_yarn applies it: low-frequency pairs are interpolated by
    the scale factor, high-frequency pairs kept, a linear ramp between; cos/sin scaled by 1 + 0.1 ln(factor)."""
    s = config.rope_scaling
    d, base = config.rope_dim, config.rope_theta
    n_ctx_orig = s.original_context_length or config.context_length

    def corr_dim(n_rot: float) -> float:
        return d * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(s.yarn_beta_fast)))
    high = min(d - 1.0, math.ceil(corr_dim(s.yarn_beta_slow)))
    i = np.arange(d // 2, dtype=np.float64)
    ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)  # 1 keeps the original frequency
    interpolated = inv_freq / s.factor
    mixed = interpolated * (1.0 - ramp) + inv_freq * ramp
    return mixed, 1.0 + s.yarn_log_multiplier * math.log(s.factor)
