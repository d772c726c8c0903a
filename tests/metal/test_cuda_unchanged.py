"""The CUDA kernels stay what the H200 verified: every patch's CUDA launches are main's, byte for byte.

The digests below were recorded by ``cuda_launches.py`` from main at commit
4ed0234 (unmodified, ``git worktree add /tmp/main 4ed0234`` then
``PYTHONPATH=/tmp/main python tests/metal/cuda_launches.py``). Each covers
the CUDA source and header text handed to ``mx.fast.cuda_kernel``, the
kernel's names and flags, and per launch the input dtypes and shapes,
template arguments, grid, threadgroup and outputs: everything MLX builds its
CUDA source and launch from.
"""

import pytest

import cuda_launches

MAIN_4ED0234 = {
    "router_select": "92c941b0cfb98dd73f1491ec979dc6667469a6bc6e8cf991a8208a7b3c9d6160",
    "expert_combine": "d5f15e74ce5c0d80bf518cc2c2dcf533373145c28bb81efcfa0dcaf2ff6b0dbf",
    "fused_kda_kernel": "e377af71d79e29810846df32587df739c9cbef36b75934a787708a708c231582",
    "hc_decode": "6693074c30a17f8eee686e51f10bfe26d7384511b27aedcb3e61af2acf79d843",
    "indexer_fp32": "a88f40ddcc82e9e4611d4b35bc732843d07a2107ef3a6a7b81859a2f0165b8d3",
    "kda_prefill_kernel": "bd99032c68bb099a8709f5158d103ac49d02ca9e76fced094a02b503af478650",
}


# exact_qmv's kernel as it passed `verify exact_qmv` on an H200 (s28, 40 cases, code digest
# ffe3e56a0dcc), recorded from that code the same way. A change here needs that CUDA verify again.
VERIFIED_S28 = {
    "exact_qmv": "064737bd7a372faaeba7c0e36aa7c45c5a57e410a8c260fd373340c12bf6d983",
}


# Kernels as they passed `verify` on an H100 (sm_90 like the H200), recorded from that code the same way.
# A change here needs that CUDA verify again.
# - block_qmv: s34, 53 cases, code digest 119594fb9efd; again in s35 after the Metal twin, code digest a15995c7ce76;
#   s44 with s42's narrower projections, 59 cases, code digest c1215e0deb55; s46 with s44's view of the
#   block's rows (the launch unchanged), 59 cases, code digest b8a9b9733d68.
# - routed_experts: the weights as the MMA's A operand, s41, 24 cases, code digest d5bc2540797f; again in s48 with
#   the Metal twin beside it (the CUDA path unchanged), 24 cases, code digest f453a0bca5c5 (then f96d2257f127:
#   a Metal-only step-aside added, not verified again); s49 with a decode step's up and gate in one launch
#   (blockIdx.z picks the projection), 34 cases, code digest 80e8f61599b9, and on its final docstrings, 34 cases,
#   code digest 3342d0e42719 (s48's launch 2fa1c13c93e8...) (s37's
#   side-by-side kernel before it: 26 cases, 1c92c91bb6e8, launch e7752bbe06ed...; s36's: 34 cases, 8f0583f2a930,
#   launch 049d2749752a...).
# - kda_verify_kernel: written in s37 without a GPU, verified in s38: 18 cases (one inconclusive: stock not
#   repeatable at 8-bit, padded batch 3), code digest ba3e6b817777, launch 7135bc24e5d7...; with s45's mixer
#   kernel (the recurrence's text behind macros both kernels share): 30 cases (two inconclusive, the same case
#   for each kernel), code digest b6c49e7534c1.
# - dsa_decode: the selection over each position of a verify block, s44, 52 cases, code digest c243d94eae51 (the
#   one-row kernel before it: s32, code digest 60c672c549d1, launch 335d96af9fb8...).
VERIFIED_H100 = {
    "dsa_decode": "d7ac80fc619206980774120401ad64ecebc1796b6da67619f6f873c4b604ac98",
    "block_qmv": "fb3bc7ce590cb9ff3bee97cd28f3bcf2e90fb3f2bc6ab9633b07d85ee62a9b29",
    "kda_verify_kernel": "ba9751bd9a555d20fe696a68a3ed1d6ffeddd1d32a310c3ae1d2bdce3983c142",
    "routed_experts": "d228700b1dc650951c816821697a9f077af49903bec12809fd75620ee8a6f82a",
}


@pytest.fixture(scope="module")
def digests():
    return cuda_launches.digests()


@pytest.mark.parametrize("patch", sorted(MAIN_4ED0234))
def test_cuda_launches_are_mains(digests, patch):
    assert digests[patch] == MAIN_4ED0234[patch], f"{patch}'s CUDA kernel text or launch differs from main's"


@pytest.mark.parametrize("patch", sorted(VERIFIED_S28))
def test_cuda_launches_are_the_verified_ones(digests, patch):
    assert digests[patch] == VERIFIED_S28[patch], f"{patch}'s CUDA kernel text or launch differs from what the H200 verified"


@pytest.mark.parametrize("patch", sorted(VERIFIED_H100))
def test_cuda_launches_are_the_h100_verified_ones(digests, patch):
    assert digests[patch] == VERIFIED_H100[patch], f"{patch}'s CUDA kernel text or launch differs from what the H100 verified"


def test_every_cuda_kernel_is_recorded():
    """Each launch record follows its kernel's construction; no patch builds a CUDA kernel unrecorded."""
    import pathlib

    import glm53_patches

    root = pathlib.Path(glm53_patches.__file__).parent
    users = {p.parent.name for p in root.rglob("*.py") if "mx.fast.cuda_kernel(" in p.read_text()}
    recorded = set(MAIN_4ED0234) | set(VERIFIED_S28) | set(VERIFIED_H100)
    assert users - {"kernels"} <= recorded  # kernels/: hc_sinkhorn, recorded as hc_decode
    assert set(cuda_launches.PATCHES) == recorded
    for name, records in cuda_launches.records().items():
        built = [r["kernel"]["name"] for r in records if "kernel" in r]
        launched = {r["launch"] for r in records if "launch" in r}
        assert built and launched == set(built), name
