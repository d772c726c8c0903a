"""glm5_next's written-out dense MLP gives the same bits as Glm5NextMLP.__call__."""

import mlx.core as mx

from mlx_vlm.models.glm5_next import outside_probe
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import Glm5NextMLP


def test_dense_mlp_is_bit_identical():
    mx.random.seed(0)
    mlp = Glm5NextMLP(TextConfig(hidden_size=64, intermediate_size=128))
    x = mx.random.normal((2, 3, 64))
    expected = Glm5NextMLP.__call__(mlp, x)
    got = outside_probe.dense_mlp(mlp, x)
    assert mx.array_equal(expected.view(mx.uint32), got.view(mx.uint32)).item()
