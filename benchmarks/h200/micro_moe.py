# Per-call time of the router selection and the expert combine, stock vs kernel (interleaved rounds).
import statistics, time
import mlx.core as mx
from mlx_vlm.models.glm5_next import language as L
from mlx_vlm.models.switch_layers import SwitchGLU
from glm53_patches.patches.router_select.kernel import router_select
from glm53_patches.patches.expert_combine.kernel import expert_combine

logits = [mx.random.normal((1, 288), key=mx.random.key(i)) for i in range(16)]
bias = 0.1 * mx.random.normal((288,))
routed = [mx.random.normal((1, 1, 8, 4096), key=mx.random.key(100 + i)).astype(mx.bfloat16) for i in range(16)]
shared = mx.random.normal((1, 1, 4096)).astype(mx.bfloat16)
weights = 2.5 * mx.softmax(mx.random.normal((1, 1, 8)), axis=-1)
mx.eval(logits, bias, routed, shared, weights)
arms = {
    "router stock": lambda i: L._expert_select(logits[i % 16], bias, 8, 1, 1, 2.5, True),
    "router kernel": lambda i: router_select(logits[i % 16], bias, 8, True, 2.5),
    "combine stock": lambda i: SwitchGLU._combine(routed[i % 16], weights, shared),
    "combine kernel": lambda i: expert_combine(routed[i % 16], weights, shared),
}
for fn in arms.values():
    for i in range(20):
        mx.eval(fn(i))
times = {k: [] for k in arms}
for r in range(6):
    for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
        fn, per = arms[name], []
        for i in range(200):
            t = time.perf_counter(); mx.eval(fn(i)); per.append(time.perf_counter() - t)
        times[name].append(statistics.median(per) * 1e6)
for name, m in times.items():
    print(f"{name:15s} {statistics.median(m):7.1f} us/call [{min(m):.1f}-{max(m):.1f}]")
