"""Each Metal kernel, as MLX would build it, type-checks as MSL (clang through glm53_patches/checks/metal).

Every case of ``cases.py`` (the shapes each patch's verify uses, inputs under
8 elements, batch 1 and 3, head dims 64 and 128, and upstream's own Metal
kernels) must type-check; hand mutations of our kernels must not.
"""

import pytest

from glm53_patches.checks.metal import cases, source, typecheck


@pytest.fixture(scope="module")
def generated():
    with source.verbose_kernels():
        return {(kernel, name): source.generated(fn, *args) for kernel, name, fn, args in cases.cases()}


@pytest.mark.parametrize("kernel", sorted(cases.KERNELS))
def test_every_case_type_checks(generated, kernel):
    ours = {name: texts for (k, name), texts in generated.items() if k == kernel}
    assert ours
    failed = {}
    for name, texts in ours.items():
        assert len(texts) == 1, f"{name}: {len(texts)} kernel launches traced"
        problems = typecheck.errors(texts[0])
        if problems:
            failed[name] = problems[:3]
    assert not failed, failed


def _one(kernel, edit, case=None):
    """The first (or the named) case of ``kernel`` with ``edit`` applied to its generated source."""
    with source.verbose_kernels():
        for k, name, fn, args in cases.cases([kernel]):
            if case is None or case in name:
                (text,) = source.generated(fn, *args)
                edited = edit(text)
                assert edited != text, "the mutation did not apply"
                return typecheck.errors(edited)
    raise AssertionError(f"no case {case!r}")


MUTATIONS = {
    # main's router_select: a pointer with no address space (thread memory) to a device input
    "wrong address space (router_select)": (
        "router_select", lambda t: t.replace("auto lg = logits", "const float* lg = logits"), None),
    # main's expert_combine: a device pointer to an input MLX passes in constant memory (2 elements)
    "device pointer to a constant input (expert_combine, top 2)": (
        "expert_combine", lambda t: t.replace("auto w = weights", "const device float* w = weights"), "1 rows, top 2"),
    # the thread attribute named only in the header: MLX adds it to the signature only when the body names it
    "undeclared attribute (dsa_decode)": (
        "dsa_decode", lambda t: t.replace("#define SEL_LANE thread_index_in_simdgroup\n", "").replace(
            "#define SEL_INLINE inline\n", "#define SEL_INLINE inline\n#define SEL_LANE thread_index_in_simdgroup\n")
        .replace("  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],\n", ""), None),
    # an implicit float -> bfloat narrowing (MSL allows only explicit ones)
    "implicit bfloat narrowing (fused_kda_kernel)": (
        "fused_kda_kernel", lambda t: t.replace("#define KD_TO_BF(x) static_cast<bfloat16_t>(x)", "#define KD_TO_BF(x) (x)"),
        None),
    "implicit bfloat narrowing (expert_combine)": (
        "expert_combine", lambda t: t.replace("static_cast<T>(w[k])", "w[k]").replace(
            "const T p = r", "const T p = (float)r"), "bfloat16 1 rows, top 8"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_mutations_fail(mutation):
    kernel, edit, case = MUTATIONS[mutation]
    assert _one(kernel, edit, case), f"{mutation}: type-checks, but must not"
