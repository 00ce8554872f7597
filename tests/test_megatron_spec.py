"""The 2d layer spec is Megatron's own GPT spec, chosen as Megatron's builder chooses it, core attention aside.

Megatron's builder here is megatron.training.models.gpt.default_layer_spec (what pretrain_gpt.py calls; the same
choices as Megatron-LM's gpt_builders.py). For every combination of the builder's arguments (normalization,
qk_layernorm, qk_l2_norm, MoE experts with dense/MoE layer patterns and grouped GEMM, use_te_activation_func,
--transformer-impl; megatron-core's TransformerConfig accepts all 48 per impl), the two specs have the same
module at every node except core attention, which is CoreAttention2D in every layer; local specs also with apex's
layer norm in play (faked), which megatron-core picks for LayerNorm models only. Transformer Engine cannot run here,
so for
--transformer-impl transformer_engine the arguments each builder passes to Megatron's spec functions are compared
instead (the functions recorded, both builders calling the same recorder).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings

import pytest

from megatron_2d.testing import tiny_gpt as tg
from megatron_2d.testing.distributed import run_on_ranks

pytestmark = pytest.mark.megatron

OPTIONS = dict(
    normalization=["LayerNorm", "RMSNorm"],
    qk_layernorm=[False, True],
    qk_l2_norm=[False, True],
    moe=[None, (4, 1, False), (4, [1, 0], True)],
    use_te_activation_func=[False, True],
)


def combinations():
    for values in itertools.product(*OPTIONS.values()):
        yield dict(zip(OPTIONS, values))


def transformer_config(impl, options):
    """megatron-core's TransformerConfig of one combination (megatron-core 0.19.2 accepts all 48)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = options["moe"]
    kwargs = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        transformer_impl=impl,
        normalization=options["normalization"],
        qk_layernorm=options["qk_layernorm"],
        qk_l2_norm=options["qk_l2_norm"],
        use_te_activation_func=options["use_te_activation_func"],
    )
    if moe is not None:
        kwargs.update(num_moe_experts=moe[0], moe_layer_freq=moe[1], moe_grouped_gemm=moe[2], moe_ffn_hidden_size=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**kwargs)


def module_tree(spec, path="layer"):
    """{path: module name} of every node of a spec (layer ModuleSpec or block TransformerBlockSubmodules)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    nodes = {}
    if isinstance(spec, ModuleSpec):
        nodes[path] = (getattr(spec.module, "__qualname__", repr(spec.module)), repr(sorted(spec.params.items())))
        spec = spec.submodules
    elif isinstance(spec, type) or callable(spec):
        nodes[path] = (getattr(spec, "__qualname__", repr(spec)), "")
        return nodes
    if spec is None:
        return nodes
    if dataclasses.is_dataclass(spec):
        items = [(f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec)]
    elif isinstance(spec, dict):
        items = list(spec.items())
    else:
        return {path: (repr(spec), "")}
    for name, child in items:
        if isinstance(child, (list, tuple)):
            for i, c in enumerate(child):
                nodes.update(module_tree(c, f"{path}.{name}[{i}]"))
        else:
            nodes.update(module_tree(child, f"{path}.{name}"))
    return nodes


class ApexFusedLayerNorm:
    """Plays apex's FusedLayerNorm (LayerNorm only), which megatron's local spec picks when apex is installed."""


def run_local_specs(rank, world):
    """Every local combination, without apex and with apex (its layer norm faked: megatron-core then picks it
    for LayerNorm models only, if the normalization reaches the spec): (compared, differences, core attentions)."""
    import megatron.core.models.backends as backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.training.models.gpt import GPTModelConfig, default_layer_spec

    from megatron_2d.megatron.core_attention import CoreAttention2D
    from megatron_2d.megatron.spec import get_gpt_layer_spec_2d

    tg.init_parallel()
    compared, differences, cores = 0, {}, set()
    for apex, options in itertools.product((False, True), combinations()):
        norm = ApexFusedLayerNorm if apex else gpt_layer_specs.WrappedTorchNorm

        def build(builder):  # megatron's RMSNorm branch overwrites the module global: reset it
            backends.LNImpl = gpt_layer_specs.LNImpl = norm
            return module_tree(
                builder(GPTModelConfig(transformer=transformer_config("local", options), vocab_size=128))
            )

        theirs, mine = build(lambda c: default_layer_spec(c, None)), build(get_gpt_layer_spec_2d)
        cores |= {name for path, (name, _) in mine.items() if path.endswith("core_attention")}
        drop = lambda tree: {p: m for p, m in tree.items() if "core_attention" not in p}  # noqa: E731
        if drop(mine) != drop(theirs):
            differences[(apex, str(options))] = sorted(set(drop(mine).items()) ^ set(drop(theirs).items()))[:4]
        compared += (
            apex
            and options["normalization"] == "LayerNorm"
            and any(m[0] == ApexFusedLayerNorm.__qualname__ for m in mine.values())
        )
        compared += not apex
    return compared, differences, sorted(cores), CoreAttention2D.__qualname__


@pytest.mark.distributed
def test_local_specs_equal_megatrons_but_core_attention():
    compared, differences, cores, expected = run_on_ranks(1, run_local_specs)[0]
    assert not differences, differences
    assert cores == [expected]
    assert compared == 48 + 24  # every combination; with apex, the 24 LayerNorm ones use its layer norm


def run_transformer_engine_arguments(rank, world):
    """--transformer-impl transformer_engine: the calls each builder makes to Megatron's spec functions."""
    import megatron.training.models.gpt as megatron_builder
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.training.models.gpt import GPTModelConfig

    import megatron_2d.megatron.spec as ours

    tg.init_parallel()
    ours.transformer_engine_available = lambda: True
    calls = []

    def recorder(name):
        real = getattr(gpt_layer_specs, name)

        @functools.wraps(real)  # the real signature: both builders see the same parameters
        def record(*args, **kwargs):
            calls.append((name, args, sorted(kwargs.items(), key=lambda kv: kv[0])))
            return gpt_layer_specs.get_gpt_layer_local_spec()  # any layer spec: TE cannot build here

        return record

    for module in (ours, megatron_builder):
        for name in ("get_gpt_layer_with_transformer_engine_spec", "get_gpt_decoder_block_spec"):
            setattr(module, name, recorder(name))
    compared, differences = 0, {}
    for options in combinations():
        config = transformer_config("transformer_engine", options)
        calls.clear()
        megatron_builder.default_layer_spec(GPTModelConfig(transformer=config, vocab_size=128), None)
        ours.get_gpt_layer_spec_2d(GPTModelConfig(transformer=config, vocab_size=128))
        if len(calls) != 2 or calls[0] != calls[1]:
            differences[str(options)] = [repr(c) for c in calls]
        compared += 1
    return compared, differences


@pytest.mark.distributed
def test_transformer_engine_specs_get_megatrons_arguments():
    compared, differences = run_on_ranks(1, run_transformer_engine_arguments)[0]
    assert not differences, differences
    assert compared == 48


def test_transformer_impl_decides_and_unsupported_builds_are_refused():
    from types import SimpleNamespace

    from megatron_2d.megatron.spec import get_gpt_layer_spec_2d, transformer_engine_available

    assert not transformer_engine_available()
    with pytest.raises(
        ValueError,
        match=r"transformer_impl is 'transformer_engine' but Transformer Engine is not "
        r"installed; install it or use --transformer-impl local",
    ):
        get_gpt_layer_spec_2d(SimpleNamespace(transformer_impl="transformer_engine"))
    for config, message in (
        (SimpleNamespace(transformer_impl="inference_optimized"), "training backend"),
        (SimpleNamespace(experimental_attention_variant="dsa"), "replaces core attention"),
        (SimpleNamespace(restore_modelopt_state=True), "ModelOpt layer specs"),
    ):
        with pytest.raises(ValueError, match=message):
            get_gpt_layer_spec_2d(config)


@pytest.mark.parametrize("name", ["GPT_LAYER_SPEC_2D", "gpt_layer_spec_2d"])
def test_every_advertised_spec_loads_through_megatrons_import_module(name):
    """``--spec megatron_2d.megatron.spec NAME`` as Megatron's builders read it (``import_module``, which returns
    ``vars(module)[name]`` and never consults a module ``__getattr__``): the ready spec is a module attribute, a
    ModuleSpec with CoreAttention2D as core attention, and the spec function is the one the module defines."""
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    import megatron_2d.megatron as package
    import megatron_2d.megatron.spec as ours
    from megatron_2d.megatron.core_attention import CoreAttention2D

    loaded = import_module(["megatron_2d.megatron.spec", name])
    assert loaded is vars(ours)[name] and loaded is getattr(package, name)
    if name == "GPT_LAYER_SPEC_2D":
        assert isinstance(loaded, ModuleSpec)
        assert loaded.submodules.self_attention.submodules.core_attention.module is CoreAttention2D
    else:
        assert callable(loaded)
