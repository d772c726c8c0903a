"""``glm53-patches verify routed_experts``: the kernel against stock's ``gather_qmm`` here.

On CUDA:

1. the op: stock's ``QuantizedSwitchLinear.__call__`` (one ``gather_qmm``)
   against the patch's replacement on the same random 4-bit experts (64 of
   them), stock run twice: the routed experts' gate/up (2048 x 4096) and
   down (4096 x 2048) projections as a decode step calls them (8 routes of
   one input; 8 routes of their own inputs), at batch 2 (16 routes) and in
   verify blocks of 2 and 7 positions (16 and 56 routes, each position's
   input shared by its 8); then the kernel's other settings, which must change
   nothing: 2 and 8 warps, 2 and 3 steps loaded ahead; up and gate of one
   input in one launch, each against its own stock call, at three settings;
   stock's ``SwitchGLU.__call__`` against the patch's decode step (gate and
   up in one launch, then stock's down) at batch 1, 2 and 7;
2. the tiny random-weight model, 4-bit, bf16, with hidden size 512, experts
   256 wide and top-8 of 16, so that its routed experts take ``qmm_sm80``
   and the kernel (K a multiple of 256 both ways): greedy decode and speculative verify blocks at batch 1 and
   2, every logit and the caches after each rollback, the kernel forced on,
   once behind ``SwitchGLU.__call__`` (a decode step's gate and up together)
   and once behind ``QuantizedSwitchLinear.__call__`` (each projection
   alone). It fails if the kernel never ran.

On Metal:

1. the op: stock's ``SwitchGLU.__call__`` (three ``gather_qmm``) against the
   patch's replacement on the same random experts (64 of them; gate and up
   2048 x 4096, down 4096 x 2048), as a decode step calls it, at batch 1, 2
   and 7 (8 to 56 routes, unsorted), 4-bit group 64 bf16 as the model ships,
   then 8- and 6-bit, group 32 and 128, float16, and 2-, 3- and 5-bit at
   smaller widths; the routed outputs before the weighted sum;
2. the tiny random-weight model, 4-bit, bf16, hidden size 512, experts 512
   wide (K a multiple of 512 both ways, gather_qmv_fast's shapes), top-8 of
   16: greedy decode and verify blocks at batch 1 and 2, every logit and
   cache, the twin forced on. It fails if the twin never ran.

Every op case runs stock twice and is inconclusive where stock differs from
itself. On the CPU there is no kernel: the patch steps aside, and only check 2
runs (stock both times).
"""

import contextlib
import time

import mlx.core as mx
from mlx_vlm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from glm53_patches import registry, tiny_model
from glm53_patches.backend import current as backend
from glm53_patches.exactness import Tally, abs_diff, compare_tiny_models, same_bits

TARGET = "mlx_vlm.models.switch_layers:QuantizedSwitchLinear.__call__"
GLU_TARGET = "mlx_vlm.models.switch_layers:SwitchGLU.__call__"
EXPERTS = 64
SHAPES = [("gate/up", 2048, 4096), ("down", 4096, 2048)]
# (label, input batch shape, route indices shape): how a step or block calls a projection
CALLS = [
    ("decode, one input", (1, 1, 1), (1, 1, 8)),
    ("decode, an input per route", (1, 1, 8), (1, 1, 8)),
    ("batch 2", (2, 1, 1), (2, 1, 8)),
    ("verify block of 2", (1, 2, 1), (1, 2, 8)),
    ("verify block of 7", (1, 7, 1), (1, 7, 8)),
]
SETTINGS = [dict(warps=2), dict(warps=8), dict(ahead=2), dict(ahead=3),
            dict(ahead=3, warps=8)]  # 3 ahead: 16 and 8 steps are not multiples of 3
PAIR_SETTINGS = [{}, dict(warps=2), dict(ahead=3, warps=8)]


def case(n, k, x_batch, routes_shape, seed):
    """A QuantizedSwitchLinear of EXPERTS random experts scaled like a layer's, an input ``x_batch + [1, k]``
    and random routes."""
    key_w, key_x, key_i = mx.random.split(mx.random.key(seed), 3)
    module = QuantizedSwitchLinear(64, 128, 1, bias=False)  # then given the case's experts
    weight = (mx.random.normal((EXPERTS, n, k), key=key_w) * k**-0.5).astype(mx.bfloat16)
    module.weight, module.scales, module.biases = mx.quantize(weight, group_size=64, bits=4)
    x = mx.random.normal((*x_batch, 1, k), key=key_x).astype(mx.bfloat16)
    picks = mx.argsort(mx.random.uniform(shape=(*routes_shape[:-1], EXPERTS), key=key_i), axis=-1)
    indices = picks[..., :routes_shape[-1]].astype(mx.uint32)  # distinct experts per position, as top-k picks
    mx.eval(module.parameters(), x, indices)
    return module, x, indices


@contextlib.contextmanager
def marked():
    """As inside a glm5_next MoE block, the kernel forced on."""
    from .. import experts

    experts._inside.depth = getattr(experts._inside, "depth", 0) + 1
    try:
        with experts.switch.forcing(True):
            yield
    finally:
        experts._inside.depth -= 1


def check_op(tally):
    from .. import experts, kernel

    stock = registry.upstream(TARGET)
    seed = 0
    for label, n, k in SHAPES:
        for call, x_batch, routes_shape in CALLS:
            seed += 1
            name = f"{label} {n}x{k}, {call}"
            try:
                module, x, indices = case(n, k, x_batch, routes_shape, seed)
                reason = experts.unsupported(module, x, indices, False)
                if reason is not None:
                    raise ValueError(f"the patch would not take this call ({reason})")
                expected, again = stock(module, x, indices), stock(module, x, indices)
                with marked():
                    actual = experts.project(module, x, indices, False)
                mx.eval(expected, again, actual)
            except Exception as exc:  # a kernel that does not build or launch is not verified
                tally.failed(name, exc)
                continue
            tally.against_stock(name, expected, again, actual)
        # the kernel's other settings, on the block of 7's call: per route, one input per position
        module, x, indices = case(n, k, (1, 7, 1), (1, 7, 8), seed + 100)
        expected = stock(module, x, indices).reshape(-1, n)
        for settings in SETTINGS:
            name = f"{label} {n}x{k}, verify block of 7, {settings}"
            try:
                actual, = kernel.expert_mma(x.reshape(-1, k), indices.reshape(-1), [experts.tensors(module)],
                                            **settings)
                mx.eval(expected, actual)
            except Exception as exc:
                tally.failed(name, exc)
                continue
            exact = same_bits(expected, actual)
            tally.add(name, exact, 0.0 if exact else abs_diff(expected, actual))
    check_pairs(tally)
    check_glu(tally, GLU_CALLS)


def check_pairs(tally):
    """Two projections of one input in one launch (a decode step's up and gate), each against its stock call."""
    from .. import experts, kernel

    stock = registry.upstream(TARGET)
    _, n, k = SHAPES[0]
    up, x, indices = case(n, k, (1, 1, 1), (1, 1, 8), 200)
    gate = case(n, k, (1, 1, 1), (1, 1, 8), 201)[0]
    expected = [stock(module, x, indices).reshape(-1, n) for module in (up, gate)]
    for settings in PAIR_SETTINGS:
        name = f"up and gate {n}x{k} in one launch, decode, {settings}"
        try:
            actual = kernel.expert_mma(x.reshape(-1, k), indices.reshape(-1),
                                       [experts.tensors(up), experts.tensors(gate)], **settings)
            mx.eval(expected, actual)
        except Exception as exc:
            tally.failed(name, exc)
            continue
        exact = all(same_bits(e, a) for e, a in zip(expected, actual))
        tally.add(name, exact, 0.0 if exact else max(abs_diff(e, a) for e, a in zip(expected, actual)))


# (label, hidden, experts' width, bits, group, dtype, batch): a decode step's SwitchGLU, on CUDA and on Metal
GLU_CALLS = [(f"batch {batch}", 4096, 2048, 4, 64, mx.bfloat16, batch) for batch in (1, 2, 7)]
METAL_CALLS = [
    *GLU_CALLS,
    ("8-bit", 4096, 2048, 8, 64, mx.bfloat16, 1),
    ("6-bit", 4096, 2048, 6, 64, mx.bfloat16, 1),
    ("group 32", 4096, 2048, 4, 32, mx.bfloat16, 1),
    ("group 128", 4096, 2048, 4, 128, mx.bfloat16, 2),
    ("float16", 4096, 2048, 4, 64, mx.float16, 2),
    *[(f"{bits}-bit", 1024, 512, bits, 64, mx.bfloat16, 2) for bits in (2, 3, 5)],
]


def glu_case(hidden, width, bits, group, dtype, batch, seed):
    """A SwitchGLU of EXPERTS random quantized experts scaled like a layer's, a decode step's input
    ``[batch, 1, hidden]`` and its top-8 routes."""
    keys = mx.random.split(mx.random.key(seed), 5)
    glu = SwitchGLU(32, 32, 1)  # then given the case's experts
    for key, name, (n, k) in zip(keys, ("gate_proj", "up_proj", "down_proj"),
                                 ((width, hidden), (width, hidden), (hidden, width))):
        module = QuantizedSwitchLinear(k, n, EXPERTS, bias=False, group_size=group, bits=bits)
        weight = (mx.random.normal((EXPERTS, n, k), key=key) * k**-0.5).astype(dtype)
        module.weight, module.scales, module.biases = mx.quantize(weight, group_size=group, bits=bits)
        setattr(glu, name, module)
    glu.eval()
    x = mx.random.normal((batch, 1, hidden), key=keys[3]).astype(dtype)
    picks = mx.argsort(mx.random.uniform(shape=(batch, 1, EXPERTS), key=keys[4]), axis=-1)
    indices = picks[..., :8].astype(mx.uint32)
    mx.eval(glu.parameters(), x, indices)
    return glu, x, indices


def check_glu(tally, calls):
    """Stock's ``SwitchGLU.__call__`` against the patch's decode step on this backend (CUDA: gate and up in one
    launch, then stock's down; Metal: the twin throughout), the routed outputs before the weighted sum."""
    from .. import experts

    stock = registry.upstream(GLU_TARGET)
    for seed, (label, hidden, width, bits, group, dtype, batch) in enumerate(calls):
        name = f"SwitchGLU {hidden}/{width}, {label}, decode at batch {batch}"
        try:
            glu, x, indices = glu_case(hidden, width, bits, group, dtype, batch, seed)
            expected, again = stock(glu, x, indices), stock(glu, x, indices)
            with marked():
                actual = experts.decode_step(glu, x, indices)
            if actual is None:
                raise ValueError("the patch would not take this call (see its fallback counts)")
            mx.eval(expected, again, actual)
        except Exception as exc:  # a kernel that does not build or launch is not verified
            tally.failed(name, exc)
            continue
        tally.against_stock(name, expected, again, actual)


def check_metal_op(tally):
    check_glu(tally, METAL_CALLS)


def check_tiny_models(tally, here):
    from .. import PATCH, experts

    # bf16 on a GPU (the kernel's dtype); elsewhere (stock both times) as the CPU runs it
    variants = [("4-bit", 4, mx.bfloat16 if here in ("cuda", "metal") else None)]
    # experts 256 wide on CUDA (K a multiple of 256 both ways), 512 on Metal (gather_qmv_fast's K)
    config = {**tiny_model.gpu_widths(), "hidden_size": 512, "moe_intermediate_size": 512 if here == "metal" else 256,
              "n_routed_experts": 16, "num_experts_per_tok": 8}
    # on CUDA both wrappers, one at a time: the decode step's gate and up in one launch (SwitchGLU), then
    # every projection alone (QuantizedSwitchLinear: decode steps and verify blocks)
    glu, projection = (SwitchGLU, GLU_TARGET, experts.make_glu_call), (QuantizedSwitchLinear, TARGET,
                                                                        experts.make_projection_call)
    hit = "metal twin" if here == "metal" else "kernel"
    for owner, target, make in {"cuda": [glu, projection], "metal": [glu]}.get(here, [projection]):
        stock = registry.upstream(target)
        before = PATCH.stats.snapshot()["hits"].get(hit, 0)
        compare_tiny_models(tally, owner, "__call__", stock, make(stock), marked, steps=4, variants=variants,
                            config=config, blocks=True)
        ran = PATCH.stats.snapshot()["hits"].get(hit, 0) - before
        if here in ("cuda", "metal") and not ran:  # equal outputs prove nothing if stock ran both times
            tally.mismatches.append(f"the {hit} never ran behind {owner.__name__}.__call__ in the model check")


def verify():
    start = time.perf_counter()
    here = backend()
    tally = Tally()
    if here == "cuda":
        check_op(tally)
    elif here == "metal":
        check_metal_op(tally)
    check_tiny_models(tally, here)
    if here not in ("cuda", "metal"):
        tally.notes.append(f"no CUDA or Metal here ({here}): the patch steps aside (stock code)")
    return tally.result(time.perf_counter() - start)
