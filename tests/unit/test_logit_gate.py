"""exactness.logit_gate, the figures every numerics-changing patch's gate asserts."""

import numpy as np

from glm53_patches.exactness import logit_gate


def test_identical_logits_pass_and_a_flipped_top1_is_seen():
    ref = np.array([[[3.0, 1.0, 0.0], [0.0, 2.0, 1.9995], [1.0, 0.0, 5.0]]])
    same = logit_gate(ref, ref.copy())
    assert same["kl_mean"] == same["kl_max"] == 0.0
    assert same["top1"] == same["positions"] == 3 and same["top1_on_clear"]
    assert abs(same["clear"] - 2 / 3) < 1e-12  # the second position is a near-tie (0.0005 apart)
    flipped = ref.copy()
    flipped[0, 1, 1], flipped[0, 1, 2] = 1.9995, 2.0  # only the near-tie flips
    gate = logit_gate(ref, flipped)
    assert gate["top1"] == 2 and gate["top1_on_clear"]
    p = np.exp(ref[0, 1] - ref[0, 1].max())
    p /= p.sum()
    expected = (p * (np.log(p) - np.log(p[[0, 2, 1]]))).sum() / 3  # KL of the swapped row, averaged
    assert abs(gate["kl_mean"] - expected) < 1e-15 and gate["kl_max"] > 0
    flipped[0, 0] = [0.0, 3.0, 1.0]  # a clear position flips
    assert not logit_gate(ref, flipped)["top1_on_clear"]
