"""outside_probe: a patch from another package, declared the way the built-in ones are.

It replaces glm5_next's dense MLP with the same arithmetic written out (exact),
and counts its calls. Its drift fingerprints, verify check and staging data live
in this package, as an outside author's would.
"""

from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

PATCH = Patch(
    name="outside_probe",
    summary="glm5_next's dense MLP, the same ops written out (a third-party test plugin)",
    targets={f"{GLM5_NEXT}:Glm5NextMLP.__call__": lazy(f"{__name__}.mlp", "make_call")},
    relies_on=(f"{GLM5_NEXT}:_limited_swiglu", "mlx_vlm.models.linear:linear"),
    numerics="exact",
    needs_verify_on=("cpu", "cuda", "metal"),  # so that `all` takes it only after its verify passed
    upstream="not proposed: a test plugin",
    verify=lazy(f"{__name__}.checks.verify", "verify"),
)


@hookimpl
def glm53_patches():
    return [PATCH]
