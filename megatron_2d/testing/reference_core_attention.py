"""An independent CP = 1 reference for Megatron's core-attention slot: plain softmax attention per document.

Megatron's local ``DotProductAttention`` is the reference wherever it runs (sbhd batches of GPT and HybridModel
layers). It has no THD path and does not take MLA's ``k_channels`` / ``v_channels``; there
:class:`ReferenceCoreAttention` stands in: :func:`megatron_2d.testing.reference.reference_attention` (plain torch,
written independently of the 2d op) over each document of a packed batch, with everything Megatron's core
attention receives from the config: causal or no mask, the softmax scale, the layer's sliding window
(``window_size`` / ``window_attn_skip_freq`` by Megatron's own ``is_layer_window_attention``) and attention sinks
(``softmax_type``: a learnable ``softmax_offset`` parameter, or off-by-one's zeros). CP = 1 only.

Shapes: sbhd q/k [s, b, h, dk], v [s, b, h, dv] -> [s, b, h * dv]; THD q/k [t, h, dk], v [t, h, dv'] -> [t, h * dv']
(under THD Megatron pads MLA's V to the query head dim dv' and trims the output after core attention: the padding
is cut here and the output padded back with zeros). Under THD each document of ``cu_seqlens_q`` attends only to
itself; slots past a document's real length in ``cu_seqlens_q_padded`` are padding (zero output, seen by nobody).

QK-clip (``qk_clip`` / ``log_max_attention_logit``): ``current_max_attn_logits`` as TEDotProductAttention keeps it
(running max over micro-batches, detached, in the output's dtype), from a brute-force max over each document's allowed
pairs (:func:`megatron_2d.testing.reference.max_logit_reference`).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from .reference import max_logit_reference, reference_attention


class ReferenceCoreAttention(MegatronModule):
    """Megatron's core-attention interface at CP = 1 (see the module docstring)."""

    def __init__(
        self,
        *,
        config,
        layer_number,
        attn_mask_type,
        attention_type="self",
        cp_comm_type=None,
        softmax_scale=None,
        pg_collection=None,
        k_channels=None,
        v_channels=None,
    ) -> None:
        super().__init__(config=config)
        if pg_collection is not None and pg_collection.cp is not None and pg_collection.cp.size() > 1:
            raise ValueError("ReferenceCoreAttention is the CP=1 reference; it does not split the sequence")
        tp = pg_collection.tp.size() if pg_collection is not None and pg_collection.tp is not None else 1
        head_dim = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self.causal = attn_mask_type == AttnMaskType.causal
        self.v_channels = v_channels
        self.window = (-1, -1)
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            self.window = tuple(config.window_size)
        heads = config.num_attention_heads // tp
        if config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, dtype=config.params_dtype), persistent=False)
        else:
            self.softmax_offset = None
        self.max_logits = bool(config.qk_clip or config.log_max_attention_logit)
        self.current_max_attn_logits = None

    def _keep_max_logit(self, documents, dtype) -> None:
        """Fold the max logit of ``documents`` ([(q, k) as [s, b, h, d]], each one sequence) into the running max."""
        if not self.max_logits:
            return
        batch_max = torch.stack(
            [
                max_logit_reference(q, k, [0, q.shape[0]], self.causal, self.softmax_scale, self.window)
                for q, k in documents
            ]
        ).amax(0)
        batch_max = batch_max.to(dtype)
        current = self.current_max_attn_logits
        self.current_max_attn_logits = batch_max if current is None else torch.max(current, batch_max)

    def _attend(self, q, k, v):
        """[s, b, h, d] -> [s, b, h, dv], computed in fp32 (fp64 stays fp64) and returned in the inputs' dtype."""
        compute = torch.promote_types(q.dtype, torch.float32)
        sinks = None if self.softmax_offset is None else self.softmax_offset.to(compute)
        out = reference_attention(
            *(x.to(compute) for x in (q, k, v)), self.causal, self.softmax_scale, self.window, sinks=sinks
        )
        return out.to(q.dtype)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_bias is not None:
            raise ValueError("ReferenceCoreAttention takes no attention_bias")
        if packed_seq_params is None:
            self._keep_max_logit([(query.detach(), key.detach())], query.dtype)
            out = self._attend(query, key, value)  # [s, b, h, dv]
            return out.reshape(out.shape[0], out.shape[1], -1)
        width = value.shape[-1]
        if self.v_channels is not None and width > self.v_channels:
            value = value[..., : self.v_channels]  # MLA under THD: Megatron's padding of V
        real = [int(x) for x in packed_seq_params.cu_seqlens_q]
        padded = packed_seq_params.cu_seqlens_q_padded
        starts = real if padded is None else [int(x) for x in padded]
        documents = [
            (query[begin : begin + b - a].detach().unsqueeze(1), key[begin : begin + b - a].detach().unsqueeze(1))
            for begin, a, b in zip(starts[:-1], real[:-1], real[1:])
            if b > a
        ]
        self._keep_max_logit(documents, query.dtype)
        out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])  # [t, h, dv]; padding stays zero
        for begin, a, b in zip(starts[:-1], real[:-1], real[1:]):
            rows = slice(begin, begin + b - a)
            out[rows] = self._attend(*(x[rows].unsqueeze(1) for x in (query, key, value))).squeeze(1)
        if out.shape[-1] < width:
            out = torch.nn.functional.pad(out, (0, width - out.shape[-1]))
        return out.reshape(out.shape[0], -1)  # [t, h * dv']
