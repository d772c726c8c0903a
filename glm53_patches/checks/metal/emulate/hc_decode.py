"""hc_decode's Metal twin (``hc_sinkhorn``'s Metal body) against mlx-vlm's own ``_hc_kernel`` on Metal.

At decode with ``hc_mult == 4`` on Metal, stock's ``HyperConnection.__call__``
runs mlx-vlm 0.7.10's fused Sinkhorn-collapse kernel
(``mlx_vlm/models/deepseek_v4/hyper_connection.py``, ``_hc_kernel``: 256
threads per row; simdgroup 0 computes pre, post and comb, a threadgroup
barrier, then all 256 threads the collapse). The twin keeps its statements
and moves ``pre`` into the collapse threads (simdgroups 1..7, 224 threads).
Both are the sources MLX generates; ``collapsed``, ``post`` and ``comb`` are
compared bit for bit. Both use ``metal::fast::exp``: the hardware's fast exp
is not the shim's, but it is the same function on both sides.
"""

import numpy as np

import mlx.core as mx

from . import PRELUDE, bits_dtype, execute, generated, host_type, launch, pairs

PROGRAM = r"""
%(stock)s
%(twin)s
int main(int argc, char** argv) {
  using T = %(T)s;
  constexpr int D = %(D)d;
  const int R = load<int>(argv[1], 1)[0];  // rows: B * L
  auto x = load<T>(argv[2], R * 4 * D);
  auto mixes = load<float>(argv[3], R * 24);
  auto scale = load<float>(argv[4], 3);
  auto base = load<float>(argv[5], 24);
  auto stock_collapsed = poisoned<T>(R * D, STOCK), twin_collapsed = poisoned<T>(R * D, TWIN);
  auto stock_post = poisoned<float>(R * 4, STOCK), twin_post = poisoned<float>(R * 4, TWIN);
  auto stock_comb = poisoned<float>(R * 16, STOCK), twin_comb = poisoned<float>(R * 16, TWIN);
  msl_run({uint(R) * 256, 1, 1}, {256, 1, 1}, [&] { %(stock_call)s; });
  msl_run({uint(R) * 256, 1, 1}, {256, 1, 1}, [&] { %(twin_call)s; });
  save(argv[6], stock_collapsed);
  save(argv[7], twin_collapsed);
  save(argv[8], stock_post);
  save(argv[9], twin_post);
  save(argv[10], stock_comb);
  save(argv[11], twin_comb);
  return 0;
}
"""


def run(tmp, x, mixes, scale, base, iters=20, eps=1e-6, twin_source=None, **build_options):
    """{"collapsed", "post", "comb": (stock bits, twin bits)} for a hyper-connection collapse at decode, emulated."""
    from mlx_vlm.models.deepseek_v4 import hyper_connection as hc

    from glm53_patches.kernels import hc_sinkhorn

    batch, length, _, hidden = x.shape
    if twin_source is None:
        twin_source = generated(lambda *a: hc_sinkhorn.hc_sinkhorn_collapse(*a, 4, iters, eps, backend="metal"),
                                x, mixes, scale, base)
    stock_source = generated(lambda *a: hc._hc_kernel(a[0], None, *a[1:], 4, iters, eps), x, mixes, scale, base)

    def call(source, side):
        return launch(source, {"x_in": "x.data()", "mixes": "mixes.data()", "scale": "scale.data()",
                               "base": "base.data()", "collapsed": f"{side}_collapsed.data()",
                               "post": f"{side}_post.data()", "comb": f"{side}_comb.data()"})

    program = PRELUDE + PROGRAM % {
        "stock": stock_source, "twin": twin_source, "T": host_type(x.dtype), "D": hidden,
        "stock_call": call(stock_source, "stock"), "twin_call": call(twin_source, "twin"),
    }
    names = ["collapsed", "post", "comb"]
    bits = {"collapsed": bits_dtype(x.dtype), "post": np.uint32, "comb": np.uint32}
    found = execute(tmp, program, {"rows": np.array([batch * length], np.int32), "x": x,
                                   "mixes": mixes.astype(mx.float32), "scale": scale, "base": base},
                    {f"{side}_{n}": bits[n] for n in names for side in ("stock", "twin")}, **build_options)
    return pairs(found, names)
