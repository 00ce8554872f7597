"""gpu-check's Megatron items: small models built from the 2d specs against Megatron's own, and Checkpoint++.

    megatron KIND        a 2-layer model from the 2d spec (Transformer Engine's or local layers) against the same
                         model from Megatron's own spec, same weights, one forward + backward at CP = 1 on one
                         device: GPT (GQA, RoPE), MLA with the latent ring and qk_layernorm (RMSNorm), a HybridModel
                         stack "*-" (attention and MLP layers through HybridStack2D)
    checkpoint++         Selective Checkpoint++ (full-layer recompute that keeps attention) against the same bf16
                         model without recompute: loss and gradients of two steps, attention run once per layer and
                         step, and the keeper's recompute checks read (they are read at its next call)

The 2d model runs in bf16 (the flash kernels' dtype), Megatron's in fp32 from the same (bf16) weights. The measure
(:func:`worst_difference`) is the worst norm-wise relative difference of the loss, the whole gradient and each
attention projection's weight gradient, over the bf16 end-to-end bound of megatron_2d.testing.reference.TOLERANCES;
parameters are matched by their checkpoint names (each layer's ``sharded_state_dict_keys_map`` applied: the latent
ring splits Transformer Engine's fused kv layernorm + up-projection), and a name only one model has fails the row.
MLA's reference core attention is testing.mla's plain softmax (Megatron's local DotProductAttention takes no MLA
head dims). TE rows need Transformer Engine (and CUDA); without it they say "not run", never "ok".
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_2d.testing.reference import TOLERANCES, norm_err

from .gpu_check_runner import Item, NotRun

DTYPE = torch.bfloat16
LAYER_KINDS = ("GPT", "MLA latent, qk_layernorm", "hybrid *-")
HYBRID_PATTERN = "*-"


@dataclass(frozen=True)
class ModelSizes:
    hidden: int
    heads: int
    query_groups: int
    seq: int
    mla: dict  # MLA's dims: latent ring head dim kv_lora_rank + qk_pos_emb_head_dim, a multiple of 8


MODEL_SIZES = {
    "cuda": ModelSizes(
        hidden=512,
        heads=8,
        query_groups=2,
        seq=1024,
        mla=dict(q_lora_rank=128, kv_lora_rank=96, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64),
    ),
    "cpu": ModelSizes(
        hidden=64,
        heads=4,
        query_groups=2,
        seq=64,
        mla=dict(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16),
    ),
}


def transformer_engine_problem(device: torch.device) -> str | None:
    """Why Transformer Engine's layers cannot run here (None if they can)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return "transformer_engine not importable"
    if device.type != "cuda":
        return "Transformer Engine's layers need CUDA"
    return None


@contextlib.contextmanager
def megatron_state(device: torch.device, seed: int = 1234) -> Iterator[None]:
    """Megatron's parallel state at TP = PP = CP = 1 on the one-rank world, its RNG tracker seeded; torn down after
    (the 2D groups of the configs built inside included)."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_2d.megatron.process_groups import destroy_2d_groups

    parallel_state.initialize_model_parallel()
    try:
        if device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        else:
            from .megatron_cpu import model_parallel_cpu_manual_seed

            model_parallel_cpu_manual_seed(seed)
        yield
    finally:
        destroy_2d_groups()
        parallel_state.destroy_model_parallel()


def tiny_config(kind: str, device: torch.device, two_d: bool, dtype: torch.dtype = DTYPE, **fields):
    """The tiny model's TinyGPTConfig in ``dtype``: Megatron's config class (the reference) or ours with
    cp_comm_type "2d"."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from megatron_2d.megatron import MLATransformerConfig2D, TransformerConfig2D

    from . import tiny_gpt as tg

    sizes = MODEL_SIZES[device.type]
    overrides = dict(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu",
        **fields,
    )
    if two_d:
        overrides.update(cp_2d_head_parallel_size=1, cp_2d_inner_ring_size=1)  # CP = 1: one rank, nothing to split
    mla = kind.startswith("MLA")
    if mla:
        overrides.update(
            multi_latent_attention=True, rope_type="rope", qk_layernorm=True, normalization="RMSNorm", **sizes.mla
        )
        if two_d:
            overrides["cp_2d_mla_ring"] = "latent"
    if kind.startswith("hybrid"):
        from .tiny_hybrid import SSM_SIZES

        overrides.update(SSM_SIZES)
    classes = (MLATransformerConfig2D, MLATransformerConfig) if mla else (TransformerConfig2D, TransformerConfig)
    layers = 2
    if kind.startswith("hybrid"):
        from megatron_2d.layout.hybrid_layers import decoder_layers

        layers = len(decoder_layers(HYBRID_PATTERN))
    return tg.TinyGPTConfig(
        num_layers=layers,
        hidden_size=sizes.hidden,
        num_attention_heads=sizes.heads,
        num_query_groups=None if mla else sizes.query_groups,
        vocab_size=256,
        seq_length=sizes.seq,
        micro_batch_size=2,
        config_class=classes[0] if two_d else classes[1],
        cp_comm_type="2d" if two_d else None,
        config_overrides=overrides,
    )


def build_model(kind: str, cfg, use_te: bool, kernel: str | None, device: torch.device) -> torch.nn.Module:
    """The model of ``kind`` for ``cfg``: from the 2d spec (``cfg`` of a 2D config class) or from Megatron's own
    spec with its own core attention (MLA: testing.mla's reference core attention)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_2d.megatron import get_gpt_layer_spec_2d
    from megatron_2d.megatron.hybrid_spec import get_hybrid_stack_spec_2d, megatron_hybrid_stack_spec
    from megatron_2d.megatron.spec import layer_specs_of, megatron_gpt_spec

    from . import tiny_gpt as tg
    from .mla import ReferenceMLACoreAttention

    two_d = cfg.cp_comm_type == "2d"
    config = tg.make_transformer_config(cfg)
    if kind.startswith("hybrid"):
        from .tiny_hybrid import build_tiny_hybrid

        spec = get_hybrid_stack_spec_2d(use_te, kernel=kernel) if two_d else megatron_hybrid_stack_spec(use_te)
        return build_tiny_hybrid(cfg, HYBRID_PATTERN, spec).to(device)
    if two_d:
        spec = get_gpt_layer_spec_2d(config, use_transformer_engine=use_te, kernel=kernel)
    else:
        spec = megatron_gpt_spec(config, use_transformer_engine=use_te)
        if kind.startswith("MLA"):
            for layer in layer_specs_of(spec):
                layer.submodules.self_attention.submodules.core_attention = ModuleSpec(ReferenceMLACoreAttention)
    return tg.build_tiny_gpt(cfg, spec).to(device)


def checkpoint_names(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters by checkpoint name: each decoder layer's ``sharded_state_dict_keys_map`` applied to its names."""
    out = {}
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    for name, param in model.named_parameters():
        match = re.match(r"(decoder\.layers\.\d+\.)(.*)", name)
        if match:
            keys_map = getattr(
                getattr(layers[int(name.split(".")[2])], "submodules_config", None), "sharded_state_dict_keys_map", {}
            )
            rest = match.group(2)
            for old, new in (keys_map or {}).items():
                if rest.startswith(old):
                    rest = new + rest[len(old) :]
            name = match.group(1) + rest
        out[name] = param
    return out


def same_names(actual: dict, expected: dict, what: str) -> None:
    if set(actual) != set(expected):
        raise AssertionError(
            f"{what}: parameters only in the 2d model {sorted(set(actual) - set(expected))}, only in "
            f"Megatron's {sorted(set(expected) - set(actual))}"
        )


@torch.no_grad()
def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``target``'s parameters set to ``source``'s, matched by checkpoint name, and ``source``'s to the values
    ``target`` holds (rounded to its dtype): both models then hold the same weights."""
    theirs, ours = checkpoint_names(source), checkpoint_names(target)
    same_names(ours, theirs, "weights")
    for name, param in ours.items():
        param.copy_(theirs[name])
        theirs[name].copy_(param)


def loss_and_grads(model: torch.nn.Module, cfg, device: torch.device) -> tuple[torch.Tensor, dict]:
    """One forward + backward of the tiny model's synthetic batch: (masked mean loss, gradients by checkpoint
    name)."""
    from . import tiny_gpt as tg

    batch = {k: v.to(device) for k, v in tg.synthetic_batch(cfg).items()}
    model.zero_grad(set_to_none=True)
    per_token = model(
        input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None, labels=batch["labels"]
    )
    loss = (per_token.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in checkpoint_names(model).items()
    }
    return loss.detach(), grads


def attention_weight(name: str) -> bool:
    """Whether parameter ``name`` is a weight matrix of an attention block (its projections, not its norms)."""
    return "self_attention." in name and name.endswith(".weight") and "norm" not in name


def worst_difference(actual: tuple[torch.Tensor, dict], expected: tuple[torch.Tensor, dict]) -> float:
    """The worst norm-wise relative difference, over the bf16 end-to-end bound, of the loss, of the whole gradient
    (every parameter's, as one vector: what the grad norm sees) and of each attention projection's weight
    gradient. (Norm parameters' gradients, sums over every token, cancel: correct bf16 models differ from fp32 by
    up to 14% there at the CUDA sizes, so they count only in the whole gradient.)"""
    (loss, grads), (ref_loss, ref_grads) = actual, expected
    same_names(grads, ref_grads, "gradients")
    names = sorted(ref_grads)
    whole = [torch.cat([g[n].double().reshape(-1) for n in names]) for g in (grads, ref_grads)]
    errors = [norm_err(loss.reshape(1), ref_loss.reshape(1)), norm_err(*whole)]
    errors += [norm_err(grads[n], ref_grads[n]) for n in names if attention_weight(n)]
    return max(errors) / TOLERANCES[DTYPE].end_to_end


def check_layers(kind: str, use_te: bool, kernel: str | None, device: torch.device) -> float:
    """The 2d model of ``kind`` against Megatron's own (see the module docstring)."""
    if use_te and (problem := transformer_engine_problem(device)):
        raise NotRun(problem)
    if kind.startswith("hybrid") and not use_te and device.type == "cuda" and transformer_engine_problem(device):
        raise NotRun("transformer_engine not importable (HybridStack builds its final norm as TENorm)")
    with megatron_state(device):
        ref_cfg = tiny_config(kind, device, two_d=False, dtype=torch.float32)
        cfg = tiny_config(kind, device, two_d=True)
        reference = build_model(kind, ref_cfg, use_te, kernel, device)
        model = build_model(kind, cfg, use_te, kernel, device)
        copy_weights(reference, model)
        return worst_difference(loss_and_grads(model, cfg, device), loss_and_grads(reference, ref_cfg, device))


RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def check_checkpoint_plus(kernel: str | None, device: torch.device) -> tuple[float, str]:
    """A 2-layer 2d GPT with Selective Checkpoint++ against the same model without recompute (Transformer Engine
    layers where they run, else local): loss and gradients of two steps on the same batch, and attention run once
    per layer and step (a recompute of it would run it twice). The keeper reads its recompute checks' verdicts
    (device-side, copied without blocking) at its next call: the second step reads the first step's, after a device
    synchronisation, so a failed check fails the row."""
    from .kernel_counts import KernelForwards

    use_te = transformer_engine_problem(device) is None
    with megatron_state(device):
        plain_cfg = tiny_config("GPT", device, two_d=True)
        cfg = tiny_config("GPT", device, two_d=True, selective_checkpoint_plus_plus=True, **RECOMPUTE)
        plain = build_model("GPT", plain_cfg, use_te, kernel, device)
        model = build_model("GPT", cfg, use_te, kernel, device)
        copy_weights(plain, model)
        with KernelForwards() as plain_forwards:
            expected = loss_and_grads(plain, plain_cfg, device)
        with KernelForwards() as forwards:
            first = loss_and_grads(model, cfg, device)
            if device.type == "cuda":
                torch.cuda.synchronize()  # the first step's verdicts have landed: the second step reads them
            second = loss_and_grads(model, cfg, device)
        if plain_forwards.count == 0 or forwards.count != 2 * plain_forwards.count:
            raise AssertionError(
                f"the block kernels ran {forwards.count} forwards in 2 steps with Checkpoint++, against "
                f"{plain_forwards.count} in 1 step without recompute (attention recomputed?)"
            )
        error = max(worst_difference(first, expected), worst_difference(second, expected))
        return error, "TE layers" if use_te else "local layers"


def megatron_items(device: torch.device, kernel: str | None) -> list[Item]:
    """The Megatron rows: every layer kind with TE's and with local layers, then Checkpoint++."""
    label = "worst difference / bound"
    items = [
        Item(
            f"megatron {kind}",
            f"{'TE' if use_te else 'local'} spec, fwd+bwd vs Megatron's own (fp32), {kernel}",
            lambda kind=kind, use_te=use_te: check_layers(kind, use_te, kernel, device),
            label=label,
        )
        for kind in LAYER_KINDS
        for use_te in (True, False)
    ]
    items.append(
        Item(
            "checkpoint++",
            f"2 layers, full recompute keeps attention, vs no recompute, {kernel}",
            lambda: check_checkpoint_plus(kernel, device),
            label=label,
        )
    )
    return items
