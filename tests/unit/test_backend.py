"""backend.sorted_gather_mm_max_experts against what the H200 showed (BENCHMARKS.md s25):
MLX 0.32.4's CUDA sorted gather_mm was right at 64 bf16 experts of 2048 x 4096 (the 45-layer
bench, bit-identical to gather_qmm), wrong from expert 128 on at 255-288 bf16 experts, and
wrong at 128 float32 experts."""

import pytest

from glm53_patches.backend import sorted_gather_mm_max_experts

BF16, FP32 = 2, 4


@pytest.mark.parametrize("experts, out, inp, itemsize, fits", [
    (64, 2048, 4096, BF16, True),    # seen right: the bench's 64-expert model
    (288, 2048, 4096, BF16, False),  # seen NaN: GLM-5.3-Flash's gate and up projections
    (288, 4096, 2048, BF16, False),  # its down projection, the same bytes per expert
    (255, 2048, 4096, BF16, False),  # seen NaN from expert 128
    (128, 2048, 4096, FP32, False),  # seen wrong
    (128, 2048, 4096, BF16, True),   # expert 127 starts 16 MiB short of 2**31 bytes
    (129, 2048, 4096, BF16, False),  # expert 128 starts at 2**31
])
def test_cuda(experts, out, inp, itemsize, fits):
    assert (experts <= sorted_gather_mm_max_experts("cuda", out, inp, itemsize)) is fits


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_no_known_limit_elsewhere(backend):
    assert sorted_gather_mm_max_experts(backend, 2048, 4096, FP32) is None
