"""Packed documents (THD) through a tiny HybridModel at CP=4 (hp 2 x cp 2) equal the CP=1 run in loss and every
gradient: Megatron's zigzag THD split (what pretrain_hybrid.py --sft builds) beside Megatron's own Mamba / GDN THD
context parallelism, and the documents layout's RoPE hook (use_document_positions) on HybridModel's rotary
embedding. A documents-layout config with Mamba layers is refused by name. Megatron's local attention has no THD
path, so the CP=1 runs use the 2d spec at CP=1 (one rank's attention, as in tests/test_megatron_packed.py, whose
helpers these are).
"""

from __future__ import annotations

import pytest

from megatron_2d_dev.hybrid_cpu import install_hybrid_cpu_shims

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

install_hybrid_cpu_shims()

from megatron_2d.megatron import destroy_2d_groups  # noqa: E402
from megatron_2d.megatron.hybrid_spec import hybrid_stack_spec_2d_local  # noqa: E402
from megatron_2d.megatron.packed_data import (  # noqa: E402
    documents_batch_on_this_cp_rank,
    groups_of_model,
    use_document_positions,
)
from megatron_2d.testing.distributed import run_on_ranks  # noqa: E402
from megatron_2d_dev import tiny_gpt as tg  # noqa: E402
from megatron_2d_dev import tiny_hybrid as th  # noqa: E402


def _packed_helpers():
    """tests/test_megatron_packed.py, loaded by path (pytest's importlib mode keeps tests/ off sys.path)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).with_name("test_megatron_packed.py")
    spec = importlib.util.spec_from_file_location("_megatron_packed_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_helpers = _packed_helpers()
PAD_TO, packed_stream, real_tokens = _helpers.PAD_TO, _helpers.packed_stream, _helpers.real_tokens

RTOL = 1e-5
SIZES = dict(seq_length=512, seed=11)
ZIGZAG = ["*-*-", "M*-M*-", "G*-"]


def params(cu_real, cu_padded):
    """PackedSeqParams as pretrain_hybrid.py's forward_step builds them (total_tokens gives Mamba its seq_idx)."""
    return tg.megatron_thd_params(cu_padded, cu_padded, total_tokens=int(cu_padded[-1]))


def run_all(rank, world):
    padded_batch, cu_real, cu_padded = packed_stream(PAD_TO)
    unpadded = real_tokens(padded_batch, cu_real, cu_padded)
    settings = (2, 1, "head_first")
    out = {}
    for pattern in ZIGZAG:
        tg.init_parallel()
        ref = th.build_tiny_hybrid(th.tiny_hybrid_config(pattern, **SIZES), pattern, hybrid_stack_spec_2d_local)
        out[("ref", pattern)] = tg.packed_forward_backward(ref, padded_batch, params(cu_real, cu_padded))
        tg.init_parallel(context_parallel_size=4)
        model = th.build_tiny_hybrid(
            th.tiny_hybrid_config(pattern, settings, **SIZES), pattern, hybrid_stack_spec_2d_local
        )
        local = tg.thd_batch_on_this_cp_rank(padded_batch, cu_real, cu_padded)
        out[("cp4", pattern)] = tg.packed_forward_backward(model, local, params(cu_real, cu_padded))
    pattern = "*-*-"
    tg.init_parallel()
    ref = th.build_tiny_hybrid(th.tiny_hybrid_config(pattern, **SIZES), pattern, hybrid_stack_spec_2d_local)
    out["ref_documents"] = tg.packed_forward_backward(ref, unpadded, params(cu_real, cu_real))
    tg.init_parallel(context_parallel_size=4)
    documents = dict(SIZES, config_overrides=dict(cp_2d_packing="documents"))
    model = use_document_positions(
        th.build_tiny_hybrid(th.tiny_hybrid_config(pattern, settings, **documents), pattern, hybrid_stack_spec_2d_local)
    )
    local, doc_params = documents_batch_on_this_cp_rank(unpadded, groups_of_model(model), cu_real)
    out["documents"] = tg.packed_forward_backward(model, local, doc_params)
    try:
        th.build_tiny_hybrid(th.tiny_hybrid_config("M*-", settings, **documents), "M*-", hybrid_stack_spec_2d_local)
    except ValueError as err:
        out["refused"] = str(err)
    destroy_2d_groups()
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(4, run_all, timeout_s=300)[0]


def assert_matches(actual, expected):
    assert actual["per_token_finite"]
    errors = tg.compare_results(actual, expected)
    bad = {k: e for k, e in errors.items() if not e < RTOL}
    assert not bad, f"relative errors above {RTOL}: {bad}"


@pytest.mark.parametrize("pattern", ZIGZAG)
def test_zigzag_thd_beside_megatron_mamba_gdn_cp_matches_cp1(results, pattern):
    assert_matches(results[("cp4", pattern)], results[("ref", pattern)])


def test_documents_rope_hook_works_on_hybrid_model(results):
    assert_matches(results["documents"], results["ref_documents"])


def test_documents_layout_with_mamba_is_refused_by_name(results):
    assert results["refused"].startswith("cp_2d_packing='documents' cannot run a model with Mamba (M) layers")
