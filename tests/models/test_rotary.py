"""Rotary frequency scaling: linear interpolation and YaRN as llama.cpp defines them."""

import dataclasses
import math

import numpy as np

from infero.checkpoint import load_checkpoint
from infero.checkpoint.config import RopeScaling
from infero.models.rotary import build_rotary


def config_with(tiny_model_path, scaling):
    return dataclasses.replace(load_checkpoint(tiny_model_path).config, rope_scaling=scaling)


def test_linear_scaling_divides_positions(tiny_model_path):
    plain = build_rotary(config_with(tiny_model_path, RopeScaling()))
    linear = build_rotary(config_with(tiny_model_path, RopeScaling(kind="linear", factor=4.0)))
    positions = np.arange(0, 400, 4)
    for a, b in zip(linear.cos_sin(positions), plain.cos_sin(positions // 4), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-12)


def test_yarn_keeps_fast_pairs_interpolates_slow_pairs_and_scales_magnitude(tiny_model_path):
    c = config_with(tiny_model_path, RopeScaling(kind="yarn", factor=8.0, original_context_length=64))
    plain = build_rotary(dataclasses.replace(c, rope_scaling=RopeScaling()))
    yarn = build_rotary(c)
    # llama.cpp's correction range: dims whose wavelength fits beta_fast (32) times in the original context
    # keep their frequency; those that fit fewer than beta_slow (1) times are divided by the factor.
    d, base = c.rope_dim, c.rope_theta

    def corr(n_rot):
        return d * math.log(64 / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0, math.floor(corr(32.0))), min(d - 1, math.ceil(corr(1.0)))
    assert 0 <= low < high < d // 2
    np.testing.assert_allclose(yarn.inv_freq[: low + 1], plain.inv_freq[: low + 1])
    np.testing.assert_allclose(yarn.inv_freq[high:], plain.inv_freq[high:] / 8.0)
    between = yarn.inv_freq[low + 1 : high]
    assert np.all(between < plain.inv_freq[low + 1 : high]) and np.all(between > plain.inv_freq[low + 1 : high] / 8)
    assert yarn.mscale == 1.0 + 0.1 * math.log(8.0)
