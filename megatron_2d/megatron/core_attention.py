"""``CoreAttention2D``: megatron-core's core_attention for cp_comm_type "2d" (CoreAttentionInterface).

Built by Megatron's SelfAttention as ``core_attention(config=, layer_number=, attn_mask_type=, attention_type=,
cp_comm_type=, softmax_scale=, pg_collection=)`` and called as
``forward(query, key, value, attention_mask, attn_mask_type=, attention_bias=, packed_seq_params=)``:
query [s/CP, b, hq/tp, d], key/value [s/CP, b, hkv/tp, d] (RoPE applied, zigzag CP shards), output
[s/CP, b, hq/tp * d]. Causality comes from the zigzag positions, so the attention_mask tensor is not read (as in
Transformer Engine's backend, the mask type decides). Every config field is honoured or refused: see
:mod:`megatron_2d.megatron.attention_settings`.

Packed documents (``packed_seq_params`` with qkv_format "thd"): query [t, hq/tp, d], key/value [t, hkv/tp, d]
(Megatron squeezes the batch dimension), output [t, hq/tp * d]. The layout is the one
``packed_seq_params.layout`` carries (the documents mode, :mod:`megatron_2d.megatron.packed_data`), else
Megatron's zigzag built from cu_seqlens_q (real lengths) and cu_seqlens_q_padded; it is built once per batch and
shared by every layer through the packed_seq_params object. Megatron's per-sequence split
(--dataloader-inter-document-masking) is the "sequence" layout (:mod:`megatron_2d.megatron.per_sequence`).

QK-clip (``config.qk_clip`` or ``log_max_attention_logit``): as megatron-core 0.19.2's TEDotProductAttention,
``current_max_attn_logits`` is the running max over the micro-batches since the last clip of the max attention
logit per query head of this TP partition ([heads / tp], detached, in the output's dtype as TE returns it), None
before the first; Megatron's ``clip_qk`` all-reduces it, clips the weights and sets it back to None. The op gives
it reduced over the CP group (``return_max_logit``); a layer that delegates to TE's CP attention keeps TE's.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import NamedTuple

import torch
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint

from ..attention import run_attention_2d
from ..call.options import AttentionOptions
from ..groups import Groups2D
from ..latent_attention import LatentDims, run_latent_attention_2d
from ..layout.band import SlidingWindow
from ..layout.choices import MegatronSplit, PackingMode
from ..packed_sharding import PackedSharding
from ..packing.modes import mode_class
from .attention_settings import check_attention_settings, packed_seq_refusals
from .checkpoint_plus import AttentionKeeper
from .dynamic import check_dynamic_config, is_dynamic
from .fields import fields_2d
from .launch_checks import check_current_launch, packing_mode
from .process_groups import GroupRegistry, model_registry
from .settings import BACKEND_NAME, layer_comm_types, layer_settings, uses_2d

SUPPORTED_MASKS = (AttnMaskType.causal, AttnMaskType.no_mask)


__all__ = ["CoreAttention2D", "LatentDims"]  # LatentDims (megatron_2d.latent_attention) selects the latent ring


class _Call(NamedTuple):
    """What one forward runs the op with besides the tensors: the groups, the layer's options (the call's mask
    applied) and the batch's packed layout (None: sbhd)."""

    groups: Groups2D
    options: AttentionOptions
    packing: PackedSharding | None


def _other_backend(config, cp_comm_type, pg_collection, **kwargs):
    """A layer whose cp_comm_type is not "2d" (per-layer lists) runs Transformer Engine's CP attention."""
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention
    except ImportError:
        HAVE_TE = False
    if not HAVE_TE:
        raise ValueError(
            f"layer {kwargs['layer_number']} asks cp_comm_type {cp_comm_type!r}, which megatron-core "
            f"runs through Transformer Engine, not installed here; without TE every CP layer must use "
            f"'{BACKEND_NAME}'"
        )
    return TEDotProductAttention(config=config, cp_comm_type=cp_comm_type, pg_collection=pg_collection, **kwargs)


def _attention_with_sinks(q, k, v, sinks=None, *, call: _Call, kept=None):
    """The op on one forward's ``call`` with the sinks positional (the Checkpoint++ keeper passes tensors
    positionally, and its record as ``kept``, which goes into the call's options)."""
    return run_attention_2d(q, k, v, call.groups, call.options.keeping(kept), sinks, call.packing)


def _latent_attention_with_sinks(q, latent, up_weight, sinks=None, *, call: _Call, dims: LatentDims, kept=None):
    """The latent ring's op (as :func:`_attention_with_sinks`)."""
    options = call.options.keeping(kept)
    return run_latent_attention_2d(q, latent, up_weight, call.groups, dims, options, sinks, call.packing)


class CoreAttention2D(MegatronModule):
    """2D-Attention (head all-to-all x Double-Ring zigzag ring) as Megatron's core attention.

    Extra spec params (override the config's ``cp_2d_*`` fields): head_parallel_size, inner_ring_size, placement, and
    kernel (a :mod:`megatron_2d.kernels` name; the config's cp_2d_kernel when None, chosen by device when that is None
    too). ``groups_2d``: the model's :class:`~megatron_2d.megatron.process_groups.GroupRegistry`, which the spec
    functions and HybridStack2D hand over with the groups they built (else ``pg_collection.groups_2d``, else the
    config's: :func:`~megatron_2d.megatron.process_groups.model_registry`); the layer keeps it as ``groups_2d``.
    Megatron's sliding window (config.window_size, window_attn_skip_freq) and softmax_type ("off-by-one", "learnable":
    attention sinks, parameter ``softmax_offset``) are honoured.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        cp_comm_type: str | None = None,
        softmax_scale: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        *,
        head_parallel_size: int | None = None,
        inner_ring_size: int | None = None,
        placement: str | None = None,
        kernel: str | None = None,
        groups_2d: GroupRegistry | None = None,
    ) -> None:
        super().__init__(config=config)
        self.v_channels = v_channels  # MLA's value head dim (its query/key head dim is k_channels)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.layer_number, self.attn_mask_type = layer_number, attn_mask_type
        self.kernel = kernel if kernel is not None else fields_2d(config).cp_2d_kernel
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        cp_size = pg_collection.cp.size() if pg_collection.cp is not None else 1
        self.delegate = None
        if cp_comm_type is None and uses_2d(config.cp_comm_type):
            # MLA's base class builds its core attention once without the layer's cp_comm_type and rebuilds it with
            # it right after: that first instance is dropped, so it takes "2d" (no TE module built just to go)
            cp_comm_type = BACKEND_NAME
        if cp_size > 1 and cp_comm_type != BACKEND_NAME:
            if not uses_2d(config.cp_comm_type):
                raise ValueError(
                    f"the 2d layer spec is in use but cp_comm_type is {config.cp_comm_type!r} for every "
                    f"layer, so no layer would run 2D attention; set cp_comm_type='2d' "
                    f"(--cp-comm-type 2d) or use megatron-core's own layer spec"
                )
            channels = {} if k_channels is None else dict(k_channels=k_channels, v_channels=v_channels)
            self.delegate = _other_backend(
                config,
                cp_comm_type,
                pg_collection,
                layer_number=layer_number,
                attn_mask_type=attn_mask_type,
                attention_type=attention_type,
                softmax_scale=softmax_scale,
                **channels,
            )
            return
        check_attention_settings(config)
        check_current_launch(config)  # the stock scripts' spec routes, the ready GPT_LAYER_SPEC_2D included
        check_dynamic_config(config)
        if attention_type != "self":
            raise ValueError(f"the 2d backend supports self attention only, got attention_type {attention_type!r}")
        if attn_mask_type not in SUPPORTED_MASKS:
            raise ValueError(
                f"attn_mask_type {attn_mask_type.name} is not supported by the 2d backend; supported: "
                f"{[m.name for m in SUPPORTED_MASKS]}"
            )
        self.dynamic = None
        self.groups_2d = model_registry(config, pg_collection, groups_2d)  # the model's, handed over by its spec
        if is_dynamic(config):  # hybrid CP: each micro-batch brings its group, run with its size's layout
            self._check_dynamic_layer(config, attn_mask_type, head_parallel_size, inner_ring_size, placement)
            self.settings = None
            self.dynamic = self.groups_2d.dynamic_for(config)
            self.groups = self.dynamic.static_groups(pg_collection.cp)  # batches without local_cp_size (or None)
        else:
            # CP=1 (e.g. the reference run): one rank, nothing to split (dropout refused above)
            self.settings = layer_settings(
                config,
                cp_size,
                head_parallel_size=head_parallel_size,
                inner_ring_size=inner_ring_size,
                placement=placement,
            )
            self.groups = self.groups_2d.groups_for(pg_collection.cp, self.settings)
        self.packing = packing_mode(config)  # the layout THD batches come in (config and launch)
        fields = fields_2d(config)  # Selective Checkpoint++: fields of TransformerConfig2D, validated there
        self.keeper = (
            AttentionKeeper(fields.selective_checkpoint_plus_plus_check, fields.selective_checkpoint_plus_plus_keep)
            if fields.selective_checkpoint_plus_plus
            else None
        )
        self.sliding_window = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            self.sliding_window = SlidingWindow(left, right)
            if attn_mask_type == AttnMaskType.causal and right not in (0, -1):
                raise ValueError(
                    f"window_size {tuple(config.window_size)} looks {right} tokens ahead on causal layer "
                    f"{layer_number}; a causal sliding window is (left, 0)"
                )
        self.tp_group = pg_collection.tp
        self._init_softmax_offset(config, heads_per_partition=config.num_attention_heads // pg_collection.tp.size())
        self.max_logits = bool(config.qk_clip or config.log_max_attention_logit)
        self.current_max_attn_logits = None
        window = (-1, -1) if self.sliding_window is None else (self.sliding_window.left, self.sliding_window.right)
        self.options = AttentionOptions(
            causal=attn_mask_type == AttnMaskType.causal,
            softmax_scale=self.softmax_scale,
            kernel=self.kernel,
            sliding_window=window,
            dkv_comm_dtype=fields.cp_2d_dkv_comm_dtype,
            return_max_logit=self.max_logits,
        )

    @property
    def current_max_attn_logits(self) -> torch.Tensor | None:
        """[heads / tp]: the running max attention logit since the last clip (see the module), or None."""
        if self.delegate is not None:
            return getattr(self.delegate, "current_max_attn_logits", None)
        return self.__dict__.get("_max_attn_logits")

    @current_max_attn_logits.setter
    def current_max_attn_logits(self, value: torch.Tensor | None) -> None:
        if self.delegate is not None:
            self.delegate.current_max_attn_logits = value
        else:
            self.__dict__["_max_attn_logits"] = value

    def _keep_max_logit(self, result, dtype: torch.dtype):
        """The op's output from ``result``; with QK-clip, ``result`` is (out, max_logit), whose max joins the
        running max (detached, in ``dtype``), as TEDotProductAttention keeps it."""
        if not self.max_logits:
            return result
        out, batch_max = result
        batch_max = batch_max.detach().to(dtype)
        current = self.current_max_attn_logits
        self.current_max_attn_logits = batch_max if current is None else torch.max(current, batch_max)
        return out

    @staticmethod
    def _check_dynamic_layer(config, attn_mask_type, head_parallel_size, inner_ring_size, placement) -> None:
        """What a layer cannot run under hybrid CP: a static layout from its spec (each group size has its own),
        a layer of another backend (this one swaps the batch's PackedSeqParams for its own layout), or a mask
        that is not causal (the data path pads each sequence at its end, which only a causal mask ignores)."""
        overrides = {
            k: v
            for k, v in dict(
                head_parallel_size=head_parallel_size, inner_ring_size=inner_ring_size, placement=placement
            ).items()
            if v is not None
        }
        if overrides:
            raise ValueError(
                f"the layer spec gives CoreAttention2D a static 2D layout {overrides}, which hybrid context "
                f"parallelism does not run (each CP group size has its own: cp_2d_dynamic_layouts)"
            )
        others = sorted({t for t in layer_comm_types(config.cp_comm_type) if t != BACKEND_NAME}, key=str)
        if others:
            raise ValueError(
                f"cp_comm_type {layer_comm_types(config.cp_comm_type)} mixes the 2d backend with {others} under "
                f"hybrid context parallelism; every layer must be '{BACKEND_NAME}' (the 2d spec's self attention "
                f"lays each micro-batch out for its own CP group, which other backends would not read)"
            )
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(
                f"attn_mask_type {attn_mask_type.name} under hybrid context parallelism: the 2d backend's hybrid "
                f"data path pads each sequence at its end to a multiple of 2 x its CP group size, which only a "
                f"causal mask leaves out of the real tokens' attention; use a causal model"
            )

    def _init_softmax_offset(self, config, heads_per_partition: int) -> None:
        """Megatron's softmax_offset: zeros for "off-by-one" (a non-persistent buffer, so that ``.cuda()`` /
        ``.to()`` move it with the module and checkpoints do not carry it, as Megatron's own), a parameter of one
        logit per local head for "learnable" (same name, so checkpoints and optimizers see the same key), marked
        tensor-parallel along its heads (Megatron's DotProductAttention leaves it unmarked, so megatron-core 0.19.2
        counts only TP rank 0's heads in the gradient norm)."""
        device = (
            torch.device("cpu")
            if config.use_cpu_initialization or not torch.cuda.is_available()
            else torch.device("cuda", torch.cuda.current_device())
        )
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
        elif config.softmax_type == "off-by-one":
            self.register_buffer(
                "softmax_offset",
                torch.zeros(heads_per_partition, device=device, dtype=config.params_dtype),
                persistent=False,
            )
        elif config.softmax_type == "learnable":
            self.register_parameter(
                "softmax_offset",
                torch.nn.Parameter(torch.empty(heads_per_partition, device=device, dtype=config.params_dtype)),
            )
            if config.perform_initialization:
                self.softmax_offset = config.init_method(self.softmax_offset)
            # one logit per head, split over TP with the heads: a tensor-parallel parameter (partition dim 0), so
            # that the gradient norm counts every TP rank's share, not TP rank 0's alone as for a replicated one
            tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        else:
            raise ValueError(
                f"softmax_type {config.softmax_type!r} is not known to the 2d backend; choose one of "
                f"['vanilla', 'off-by-one', 'learnable']"
            )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None):
        """The learnable softmax offset, sharded over TP like Megatron's own core attention."""
        if self.delegate is not None:
            return self.delegate.sharded_state_dict(prefix, sharded_offsets, metadata)
        state_dict = self.state_dict(prefix="", keep_vars=True) if self.config.softmax_type == "learnable" else {}
        return make_sharded_tensors_for_checkpoint(
            state_dict,
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        *,
        latent: LatentDims | None = None,
    ) -> torch.Tensor:
        """[s/CP, b, hq/tp, dk] x2 + [s/CP, b, hkv/tp, dv] -> [s/CP, b, hq/tp * dv] (dv = dk unless MLA).

        With ``latent`` (MLA's latent ring, cp_2d_mla_ring="latent", :mod:`megatron_2d.megatron.mla`): ``key`` is
        the latent [s/CP, b, kv_lora_rank + rope dim] and ``value`` linear_kv_up_proj's weight; the output is the
        same, through :func:`megatron_2d.latent_attention_2d`. A module call either way, so that every forward
        pre-hook of this module runs (Megatron's DDP waits there for softmax_offset's all-gather)."""
        if latent is not None:
            return self._latent_forward(query, key, value, latent, attn_mask_type, attention_bias, packed_seq_params)
        if self.delegate is not None:
            return self.delegate(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        sequence_groups = getattr(packed_seq_params, "groups", None)
        if sequence_groups is not None:  # hybrid CP, one sequence: Megatron's 2 x g zigzag is the sbhd layout
            return self._sequence_forward(query, key, value, attn_mask_type, attention_bias, packed_seq_params)
        call = self._call(query, attn_mask_type, attention_bias, packed_seq_params)
        packed_width = value.shape[-1]
        if call.packing is not None and self.v_channels is not None and packed_width > self.v_channels:
            # MLA under THD: Megatron pads V to the query's head dim before core attention and trims the output
            # after it; the op takes V as it is (no padding on the wire) and the output is padded back here
            value = value[..., : self.v_channels]
        out = self._keep_max_logit(self._run(_attention_with_sinks, (query, key, value), call), query.dtype)
        if out.shape[-1] < packed_width:
            out = torch.nn.functional.pad(out, (0, packed_width - out.shape[-1]))
        return self._flatten_heads(out, call.packing)

    def _sequence_forward(self, query, key, value, attn_mask_type, attention_bias, params) -> torch.Tensor:
        """A hybrid-CP micro-batch of one sequence (``params``: its SequenceParams2D): [t, hq/tp, d] x3 ->
        [t, hq/tp * dv]. Megatron's 2 x g zigzag of it is the sbhd layout on its groups; where the params say
        where the bridge's end padding starts (``padded_layout``, under QK-clip) it runs as that one padded
        document (THD), so that the padding rows stay out of the max logit."""
        layout = params.padded_layout
        tensors = (query, key, value) if layout is not None else tuple(x.unsqueeze(1) for x in (query, key, value))
        call = self._call(tensors[0], attn_mask_type, attention_bias, None, groups=params.groups)
        call = call._replace(packing=layout)  # [t, h, d] as THD, else [t, b=1, h, d]
        out = self._keep_max_logit(self._run(_attention_with_sinks, tensors, call), query.dtype)
        return out.reshape(out.shape[0], -1)  # [t, hq/tp * dv]

    def _latent_forward(
        self, query, latent, up_weight, dims: LatentDims, attn_mask_type, attention_bias, packed_seq_params
    ) -> torch.Tensor:
        """The latent ring (see :meth:`forward`): [s/CP, b, hq/tp * dv] (THD: [t, ...] without b)."""
        if self.delegate is not None:
            raise ValueError(
                f"layer {self.layer_number} runs Transformer Engine's CP attention (its cp_comm_type is "
                f"not '2d'), which has no latent ring; use cp_2d_mla_ring='expanded'"
            )
        call = self._call(query, attn_mask_type, attention_bias, packed_seq_params)
        op = partial(_latent_attention_with_sinks, dims=dims)
        out = self._run(op, (query, latent, up_weight), call, names=("q", "latent", "up_weight"))
        return self._flatten_heads(self._keep_max_logit(out, query.dtype), call.packing)

    def _call(
        self,
        query: torch.Tensor,
        attn_mask_type: AttnMaskType | None,
        attention_bias: torch.Tensor | None,
        packed_seq_params,
        groups=None,
    ) -> _Call:
        """The groups, options and packed layout of one call, after the call's checks; ``groups``: the call's 2D
        groups when not the layer's or the layout's (a hybrid-CP sequence's)."""
        packing = self._packed_sharding(packed_seq_params, query)
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the 2d backend")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in SUPPORTED_MASKS:
            raise ValueError(
                f"attn_mask_type {mask_type.name} is not supported by the 2d backend; supported: "
                f"{[m.name for m in SUPPORTED_MASKS]}"
            )
        groups = groups if groups is not None else packing.groups if packing is not None else self.groups
        if groups is None:
            raise ValueError(self._dynamic_batch_problem(packed_seq_params))
        options = self.options
        if mask_type != self.attn_mask_type:  # a mask given to this forward (causal or no mask, checked above)
            options = replace(options, causal=mask_type == AttnMaskType.causal)
        return _Call(groups, options, packing)

    def _run(self, op, tensors, call: _Call, names=("q", "k", "v")) -> torch.Tensor:
        """``op(*tensors, sinks, call=call)``, through the Checkpoint++ keeper when it is on, which adds its record
        of the call as ``kept`` (``names``: the tensors' names in its messages)."""
        attention = partial(op, call=call)
        if self.keeper is None:
            return attention(*tensors, self.softmax_offset)
        return self.keeper(attention, *tensors, self.softmax_offset, names=names)

    @staticmethod
    def _flatten_heads(out: torch.Tensor, packing) -> torch.Tensor:
        if packing is not None:
            return out.reshape(out.shape[0], -1)  # [t, hq/tp * dv]
        return out.view(out.shape[0], out.shape[1], -1)  # [s/CP, b, hq/tp * dv]

    def _dynamic_batch_problem(self, packed_seq_params) -> str:
        """Why a batch cannot run on this layer under hybrid CP (it came without its layout, or without its
        group where the static CP group has no 2D groups)."""
        if packed_seq_params is not None and getattr(packed_seq_params, "local_cp_size", None) is not None:
            return (
                "a hybrid context-parallel micro-batch (packed_seq_params.local_cp_size set) reached the 2d core "
                "attention without its layout: build the model with the 2d layer spec (get_gpt_layer_spec_2d / "
                "gpt_layer_spec_2d), whose self attention (SelfAttention2D) lays the micro-batch out for its CP "
                "group and puts RoPE at each token's position"
            )
        return (
            "under hybrid context parallelism every micro-batch brings its CP group (packed_seq_params.local_cp_size "
            "and cp_group, as Megatron's hybrid schedule sets them); this one does not, and the model's static CP "
            "group is not one of the hybrid groups the 2D groups were built for"
        )

    def _layout_of(self, packed_seq_params, mode: str) -> PackedSharding:
        """The layout of a THD batch Megatron split itself, by the split of ``mode``
        (:attr:`megatron_2d.packing.modes.PackingMode.megatron_split`): per sequence, the sequence layout; per
        document (or a batch that should have carried its layout), the zigzag layout of cu_seqlens_q (real) and
        cu_seqlens_q_padded. The cu_seqlens live on the GPU in Megatron's batches: reading them is this batch's one
        device-to-host copy (a layout built ahead, as the data path's PackedSeqParams2D carry, needs none)."""
        real, padded = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
        if mode_class(mode).megatron_split == MegatronSplit.PER_SEQUENCE:
            from .per_sequence import sequence_params

            return sequence_params(packed_seq_params, self.groups, torch.device("cpu")).layout
        if padded is None or padded is real:
            return PackedSharding(torch.as_tensor(real).cpu(), self.groups, mode=PackingMode.ZIGZAG)
        if torch.as_tensor(padded).shape != torch.as_tensor(real).shape:  # refused by the layout
            return PackedSharding(real, self.groups, mode=PackingMode.ZIGZAG, cu_seqlens_padded=padded)
        both = torch.cat([torch.as_tensor(real).reshape(-1), torch.as_tensor(padded).reshape(-1)]).cpu()
        real, padded = both.split(both.shape[0] // 2)
        return PackedSharding(
            real, self.groups, mode=PackingMode.ZIGZAG, cu_seqlens_padded=None if torch.equal(real, padded) else padded
        )

    def _checked_layout(self, packed_seq_params, carried: PackedSharding | None) -> PackedSharding:
        """The layout of a THD batch (the one it carries, else :meth:`_layout_of`), after the refusals of its
        params."""
        problems = packed_seq_refusals(packed_seq_params)
        if problems:
            raise ValueError("; ".join(problems))
        return carried if carried is not None else self._layout_of(packed_seq_params, self.packing)

    def _packed_sharding(self, packed_seq_params, query: torch.Tensor) -> PackedSharding | None:
        """The PackedSharding of a THD batch (None for sbhd), built on the first layer and kept with the groups
        (``Groups2D.batch_layouts``, a bounded cache keyed by the params object, which its entry holds: no other
        object can then have its id)."""
        if packed_seq_params is None:
            return None
        if query.dim() != 3:
            raise ValueError(f"THD query must be [t, heads, d], got {tuple(query.shape)}")
        carried = getattr(packed_seq_params, "layout", None)
        groups = carried.groups if carried is not None else self.groups
        if groups is None or (self.dynamic is not None and carried is None):
            raise ValueError(self._dynamic_batch_problem(packed_seq_params))
        _, layout = groups.batch_layouts.get_or_build(
            id(packed_seq_params), lambda: (packed_seq_params, self._checked_layout(packed_seq_params, carried))
        )  # once per batch: the first layer checks and builds, the rest reuse
        wanted = self.packing
        if layout.mode != wanted and layout.groups.layout.cp_size > 1:
            raise ValueError(
                f"the 2d backend expects packed batches in the {wanted!r} layout (cp_2d_packing "
                f"{fields_2d(self.config).cp_2d_packing!r}) but the batch comes in the "
                f"{layout.mode!r} layout: "
                + (
                    f"build batches with {mode_class(wanted).data_path}"
                    if mode_class(wanted).megatron_split is None
                    else f"set cp_2d_packing={layout.mode!r} (--cp-2d-packing {layout.mode}) for batches of that "
                    f"data path"
                )
            )
        return layout
