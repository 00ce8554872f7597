"""Every TransformerConfig field is honoured, refused or outside core attention; refusals name the setting."""

from __future__ import annotations

import dataclasses
import re

import pytest
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_2d.megatron import TransformerConfig2D
from megatron_2d.megatron.attention_settings import (
    HONOURED,
    MLA_HONOURED,
    MLA_OUTSIDE,
    OUTSIDE,
    REFUSED,
    attention_refusals,
)


def test_every_config_field_is_classified():
    """Fails when a megatron-core upgrade adds a field nobody has classified (it might change attention); MLA's
    config (a TransformerConfig subclass) included."""
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    assert fields >= {f.name for f in dataclasses.fields(TransformerConfig)}
    classified = [*HONOURED, *MLA_HONOURED, *REFUSED, *OUTSIDE, *MLA_OUTSIDE]
    assert len(classified) == len(set(classified)), "a field is classified twice"
    unclassified = sorted(fields - set(classified))
    assert not unclassified, (
        f"new (MLA)TransformerConfig fields {unclassified}: classify each in "
        f"megatron_2d/megatron/attention_settings.py (honoured, refused or outside)"
    )
    assert not sorted(set(classified) - fields), "classified fields that TransformerConfig no longer has"


BASE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=2,
    context_parallel_size=4,
    cp_comm_type="2d",
    cp_2d_head_parallel_size=2,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(deterministic_mode=True), r"deterministic_mode=True: deterministic mode is not guaranteed"),
        (dict(fp8_dot_product_attention=True), r"fp8_dot_product_attention=True: fp8 dot-product attention"),
        (dict(fp8_multi_head_attention=True), r"fp8_multi_head_attention=True: fp8 multi-head attention"),
        (
            dict(fp8_dot_product_attention=True, qk_clip=True),
            r"fp8_dot_product_attention=True: .* \(with qk_clip / log_max_attention_logit no backend runs it",
        ),
        (
            dict(fp8_multi_head_attention=True, log_max_attention_logit=True),
            r"fp8_multi_head_attention=True: .* Transformer Engine switches every attention backend off",
        ),
        (dict(use_kitchen_attention=True), r"use_kitchen_attention=True: kitchen attention replaces core attention"),
        (dict(experimental_attention_variant="dsa"), r"experimental_attention_variant='dsa': experimental attention"),
        (dict(cache_mla_latents=True), r"cache_mla_latents=True: caching MLA latents is for Megatron's dynamic"),
    ],
)
def test_refused_settings_name_themselves(setting, message):
    config = dataclasses.replace(
        TransformerConfig(**{k: v for k, v in BASE.items() if not k.startswith("cp_2d")}), cp_comm_type=None
    )
    for name, value in setting.items():
        object.__setattr__(config, name, value)  # the check itself, without megatron's own validation
    problems = attention_refusals(config)
    assert any(re.search(message, p) for p in problems), problems


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(qk_clip=True, fp8_dot_product_attention=True), r"fp8_dot_product_attention=True.*qk_clip"),
        (dict(deterministic_mode=True), r"deterministic_mode=True"),
        (dict(attention_dropout=0.1), r"attention_dropout=0.1: attention dropout is not supported by the 2d backend"),
    ],
)
def test_config_build_refuses(setting, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig2D(**{**BASE, **setting})


def test_honoured_settings_build():
    config = TransformerConfig2D(
        **BASE,
        window_size=(64, 0),
        window_attn_skip_freq=2,
        softmax_type="learnable",
        apply_query_key_layer_scaling=True,
        qk_clip=True,
        log_max_attention_logit=True,
    )
    assert attention_refusals(config) == [] and config.window_size == (64, 0) and config.qk_clip


def test_dkv_comm_dtype_setting_is_checked():
    assert TransformerConfig2D(**BASE, cp_2d_dkv_comm_dtype="input").cp_2d_dkv_comm_dtype == "input"
    with pytest.raises(ValueError, match=r"cp_2d_dkv_comm_dtype 'fp8' is not one of \['accumulator', 'input'\]"):
        TransformerConfig2D(**BASE, cp_2d_dkv_comm_dtype="fp8")
    with pytest.raises(ValueError, match=r"2D settings \{'cp_2d_dkv_comm_dtype': 'input'\} are set but cp_comm_type"):
        TransformerConfig2D(
            **{**BASE, "cp_comm_type": None, "cp_2d_head_parallel_size": None}, cp_2d_dkv_comm_dtype="input"
        )


def test_every_packed_seq_params_field_is_classified():
    """packed_seq_params is a forward argument: each field is honoured, refused when set, or shown to have no
    effect on core attention's math; an upgrade that adds one fails here until it is classified."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_2d.megatron.attention_settings import PACKED_SEQ_PARAMS

    assert {f.name for f in dataclasses.fields(PackedSeqParams)} == set(PACKED_SEQ_PARAMS)


def test_packed_seq_params_refusals_name_the_field():
    import dataclasses

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_2d.megatron.attention_settings import packed_seq_refusals

    cu, padded = torch.tensor([0, 5, 9], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32)
    ok = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=8,
        max_seqlen_kv=8,
        tokens_per_sample=16,
    )
    assert packed_seq_refusals(ok) == []
    cases = {
        "qkv_format 'sbhd'": dict(qkv_format="sbhd"),
        "cu_seqlens_kv differs from cu_seqlens_q": dict(cu_seqlens_kv=torch.tensor([0, 4, 9], dtype=torch.int32)),
        "cu_seqlens_kv_padded differs": dict(cu_seqlens_kv_padded=None),
        "packed_seq_params.local_cp_size is set": dict(local_cp_size=2),
        "packed_seq_params.cp_group is set": dict(cp_group=object()),
    }
    for message, change in cases.items():
        problems = packed_seq_refusals(dataclasses.replace(ok, **change))
        assert len(problems) == 1 and message in problems[0], (message, problems)


CUDA_GRAPHS = [  # (settings, refused): graphs that capture core attention are refused, the others are fine
    (dict(cuda_graph_impl="local"), True),  # the whole layer
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn"]), True),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["attn", "mlp"]), True),
    (dict(cuda_graph_impl="full_iteration", cuda_graph_modules=[]), True),
    (dict(enable_cuda_graph=True), True),  # deprecated: local, whole layer
    (dict(external_cuda_graph=True, cuda_graph_scope=["attn"]), True),  # deprecated: TE, attention
    (dict(cuda_graph_impl="local", cuda_graph_modules=["mlp"]), False),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["mlp"]), False),
    (dict(cuda_graph_impl="none"), False),
]


@pytest.mark.parametrize("setting, refused", CUDA_GRAPHS, ids=[str(s) for s, _ in CUDA_GRAPHS])
def test_cuda_graphs_that_capture_attention_are_refused(setting, refused):
    """At config build (megatron's own __post_init__ normalises the deprecated fields first), naming the scope."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's deprecation notes
        if not refused:
            assert attention_refusals(TransformerConfig2D(**BASE, **setting)) == []
            return
        with pytest.raises(
            ValueError,
            match=r"cuda_graph_impl='(local|transformer_engine|full_iteration)': CUDA "
            r"graphs capturing core attention \((cuda_graph_modules=\[.*\] \((the "
            r"whole layer|attention included)\)|a full-iteration graph)\) cannot "
            r"replay the 2d backend.*cuda_graph_modules without 'attn'",
        ):
            TransformerConfig2D(**BASE, **setting)


def test_attention_2d_refuses_to_run_inside_a_graph_capture(monkeypatch):
    """Any other capture (inference graphs, a user's own) is stopped when the op runs (the capture is faked: no
    CUDA here; tools/gpu_smoke.py checks it on a GPU)."""
    import torch

    from megatron_2d.attention import check_not_capturing

    check_not_capturing(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    check_not_capturing(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"attention_2d cannot run inside a CUDA graph capture"):
        check_not_capturing(torch.device("cuda"))
    check_not_capturing(torch.device("cpu"))
