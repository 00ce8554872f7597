"""Stock Megatron dynamic (hybrid) and static context parallelism on CPU ranks: megatron-core's own
``TEDotProductAttention`` over Transformer Engine's p2p (test and benchmark support; the stock rows of
tools/bench_dynamic.py).

    with te_context_parallel_on_cpu("2.20.2", megatron=True, claim_cuda=False):   # in the parent, before forking
        ...                                                                    # in a forked rank:
        model, config = stock_hybrid_model(cfg, max_seqlen_per_rank=256)       # DP x CP = world, static CP 1
        with hybrid_cp_fixes():
            reports = dynamic_cp.hybrid_train_step(model, config, samples)     # Megatron's hybrid schedule
        model = stock_static_model(cfg, context_parallel_size=4)              # --cp-comm-type p2p, THD
        reports = dynamic_cp.static_train_step(model, samples)

Both models are megatron-core's local GPT layers with its TEDotProductAttention as core attention
(:mod:`.stock_cp_spec`), ``cp_comm_type="p2p"``; TE's fused attention takes bf16 / fp16 only. Under hybrid CP the
model is built with a static CP size of 1 and ``TEDotProductAttention.forward`` re-binds TE's CP group from each
micro-batch's ``PackedSeqParams.cp_group`` (``local_cp_size == 1``: CP off), as Megatron runs it.

megatron-core 0.19.2 as released does not run that path, here as on GPUs (both faults reproduced on CPU ranks, TE
2.20.2; Megatron-LM #6821, merged after 0.19.2, reports them on GPUs and fixes them):

  F1. RoPE gets the static CP group. ``Attention.forward`` passes ``pg_collection.cp`` (size 1 under hybrid CP) to
      ``apply_rotary_pos_emb`` while the micro-batch holds its runtime group's zigzag share of a sequence whose
      ``cu_seqlens`` are the whole one's: with --no-rope-fusion (the CPU path) ``torch.split`` fails
      (``split_with_sizes expects split_sizes to sum exactly to 60 ..., but got split_sizes=[240]``, a sequence of
      240 tokens on a group of 4); #6821 reports illegal memory accesses or wrong positions from the fused kernel.
  F2. ``TEDotProductAttention.cp_stream`` is allocated only when the static CP size is above 1; under hybrid CP it
      stays None, and TE's p2p waits on it: ``AttributeError: 'NoneType' object has no attribute 'wait_event'``.

:func:`hybrid_cp_fixes` makes #6821's two changes (their behaviour, not its code) for the enclosed block: the
runtime group (``packed_seq_params.cp_group``, when set) reaches RoPE, and the stream exists (a CPU no-op stream in
TE's CPU context). Everything is restored on exit. The static path needs neither.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from .stock_cp_spec import gpt_layer_spec_stock_cp
from .te_context_parallel import EXTENSION
from .tiny_gpt import TinyGPTConfig, build_tiny_gpt, init_parallel, make_transformer_config

_RUNTIME_CP_GROUP: contextvars.ContextVar = contextvars.ContextVar("runtime_cp_group", default=None)
"""The CP group of the micro-batch an ``Attention.forward`` inside :func:`hybrid_cp_fixes` runs (None: static)."""


@contextlib.contextmanager
def hybrid_cp_fixes() -> Iterator[None]:
    """Megatron-LM #6821's two fixes of hybrid CP with TEDotProductAttention (module docstring, F1 and F2) for the
    enclosed block; megatron-core's TE extension must be loaded (TE's CPU context with ``megatron=True``)."""
    from megatron.core.transformer import attention

    extension = sys.modules.get(EXTENSION)
    if extension is None or not getattr(extension, "HAVE_TE", False):
        raise RuntimeError("hybrid_cp_fixes patches megatron-core's TEDotProductAttention: enter TE's context first")
    te_attention = extension.TEDotProductAttention
    forward, rope, stream = attention.Attention.forward, attention.apply_rotary_pos_emb, te_attention.cp_stream
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def forward_with_runtime_group(self, *args, **kwargs):
        params = signature.bind(self, *args, **kwargs).arguments.get("packed_seq_params")
        token = _RUNTIME_CP_GROUP.set(getattr(params, "cp_group", None))
        try:
            return forward(self, *args, **kwargs)
        finally:
            _RUNTIME_CP_GROUP.reset(token)

    @functools.wraps(rope)
    def rope_on_runtime_group(*args, **kwargs):
        group = _RUNTIME_CP_GROUP.get()
        if group is not None:  # F1: the micro-batch's group, which its tokens are split over
            bound = inspect.signature(rope).bind(*args, **kwargs)
            bound.arguments["cp_group"] = group
            return rope(*bound.args, **bound.kwargs)
        return rope(*args, **kwargs)

    attention.Attention.forward = forward_with_runtime_group
    attention.apply_rotary_pos_emb = rope_on_runtime_group
    if stream is None:  # F2
        te_attention.cp_stream = torch.cuda.Stream()
    try:
        yield
    finally:
        attention.Attention.forward, attention.apply_rotary_pos_emb = forward, rope
        te_attention.cp_stream = stream


def stock_config(cfg: TinyGPTConfig, **overrides: Any) -> TinyGPTConfig:
    """``cfg`` for stock CP: Transformer Engine's p2p, per-token loss, no RoPE fusion, and ``overrides``."""
    fields = dict(cfg.config_overrides, calculate_per_token_loss=True, apply_rope_fusion=False, **overrides)
    return replace(cfg, cp_comm_type="p2p", config_overrides=fields)


def stock_hybrid_model(cfg: TinyGPTConfig, max_seqlen_per_rank: int) -> tuple[torch.nn.Module, Any]:
    """(model, its TransformerConfig) on this world under hybrid CP (parallel state initialized here: static CP 1,
    ``hybrid_context_parallel=True``, DP = world), built with the stock-CP spec."""
    init_parallel(context_parallel_size=1, seed=cfg.seed, hybrid_context_parallel=True)
    stock = stock_config(cfg, hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=max_seqlen_per_rank)
    config = make_transformer_config(stock)
    return build_tiny_gpt(stock, gpt_layer_spec_stock_cp(config), config), config


def stock_static_model(cfg: TinyGPTConfig, context_parallel_size: int) -> torch.nn.Module:
    """The model on this world at a static CP size (DP = world / CP), TE's p2p over the CP group, built with the
    stock-CP spec."""
    init_parallel(context_parallel_size=context_parallel_size, seed=cfg.seed)
    stock = stock_config(cfg)
    config = make_transformer_config(stock)
    return build_tiny_gpt(stock, gpt_layer_spec_stock_cp(config), config)
