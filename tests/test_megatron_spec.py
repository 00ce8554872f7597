"""The 2d layer spec is Megatron's own GPT spec, chosen as Megatron's builder chooses it, core attention aside.

Megatron's builder here is megatron.training.models.gpt.default_layer_spec (what pretrain_gpt.py calls; the same
choices as Megatron-LM's gpt_builders.py). Every combination of the builder's arguments is generated
(normalization, qk_layernorm, qk_l2_norm, MoE experts with dense/MoE layer patterns and grouped GEMM,
use_te_activation_func, dense / MLA / MLA with fused down projection, each MLA with the expanded or the latent
ring; for TE also the op fuser and grouped GEMM for dense MLPs): where Megatron's builder refuses one, ours refuses
it too; elsewhere the two specs have the same module at every node except core attention (CoreAttention2D in
every layer) and the latent ring's documented changes (:func:`documented_2d_tree`). Local specs also with apex's
layer norm in play (faked), which megatron-core picks for LayerNorm models only. Transformer Engine specs are
built with TE's classes as named placeholders (megatron_2d_dev.te_spec_cpu: specs are never instantiated),
as is Megatron's hybrid stack spec; the arguments each builder passes to Megatron's TE spec functions are also
compared (the functions recorded, both builders calling the same recorder).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import sys
import warnings
from unittest import mock

import pytest

from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d_dev import tiny_gpt as tg
from megatron_2d_dev.mla import MLA_DIMS

pytestmark = pytest.mark.megatron

OPTIONS = dict(
    normalization=["LayerNorm", "RMSNorm"],
    qk_layernorm=[False, True],
    qk_l2_norm=[False, True],
    moe=[None, (4, 1, False), (4, [1, 0], True)],
    use_te_activation_func=[False, True],
)


def combinations(options=OPTIONS):
    for values in itertools.product(*options.values()):
        yield dict(zip(options, values))


ATTENTION = {
    "dense": {},
    "mla": MLA_DIMS,
    "mla_latent": {**MLA_DIMS, "cp_2d_mla_ring": "latent"},
    "mla_fused": {**MLA_DIMS, "mla_down_proj_fusion": True},
    "mla_fused_latent": {**MLA_DIMS, "mla_down_proj_fusion": True, "cp_2d_mla_ring": "latent"},
}
"""Self attention of a combination, as config fields: Megatron's, or (MLA) with the 2d latent ring."""

LOCAL_OPTIONS = dict(OPTIONS, attention=list(ATTENTION))
"""The local builder's arguments and the attention."""

TE_OPTIONS = dict(
    OPTIONS,
    attention=list(ATTENTION),
    op_fuser=[False, True],
    dense_grouped_gemm=[False, True],
)
"""The Transformer Engine builder's arguments: OPTIONS, the attention, TE's op fuser and grouped GEMM for dense
MLPs (the two are passed to Megatron's TE spec only)."""


def transformer_config(impl, options):
    """The config of one combination: megatron_2d's TransformerConfig2D / MLATransformerConfig2D (CP=1, "2d"), so
    that it can ask for the latent ring; raises where megatron-core's config refuses the combination."""
    from megatron_2d.megatron import MLATransformerConfig2D, TransformerConfig2D

    moe = options["moe"]
    attention = ATTENTION[options.get("attention", "dense")]
    kwargs = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        transformer_impl=impl,
        normalization=options["normalization"],
        qk_layernorm=options["qk_layernorm"],
        qk_l2_norm=options["qk_l2_norm"],
        use_te_activation_func=options["use_te_activation_func"],
        use_transformer_engine_op_fuser=options.get("op_fuser", False),
        use_grouped_gemm_for_dense_mlp=options.get("dense_grouped_gemm", False),
        cp_comm_type="2d",
        cp_2d_head_parallel_size=1,
        attention_dropout=0.0,
        **attention,
    )
    if moe is not None:
        kwargs.update(num_moe_experts=moe[0], moe_layer_freq=moe[1], moe_grouped_gemm=moe[2], moe_ffn_hidden_size=32)
    config_class = MLATransformerConfig2D if attention else TransformerConfig2D
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_class(**kwargs)


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


LATENT_CLASSES = {"MLASelfAttention": "MLASelfAttention2D", "FusedMLASelfAttention": "FusedMLASelfAttention2D"}


def documented_2d_tree(theirs, options, impl):
    """Megatron's module tree with the changes the 2d spec documents (megatron_2d.megatron.mla), core attention
    aside: under the latent ring MLA's self attention is its 2D subclass and, in a TE spec with qk_layernorm, TE's
    fused layernorm+linear kv up-projection is split into TE's norm (kv_layernorm) and TE's linear, the norm keeping
    TE's checkpoint key through the layer's sharded-state-dict map."""
    tree = dict(theirs)
    if "latent" not in options.get("attention", ""):
        return tree
    for path, (name, params) in theirs.items():
        if name not in LATENT_CLASSES:
            continue
        tree[path] = (LATENT_CLASSES[name], params)
        if impl == "transformer_engine" and options["qk_layernorm"]:
            assert theirs[f"{path}.linear_kv_up_proj"] == ("TELayerNormColumnParallelLinear", ""), path
            assert theirs[f"{path}.kv_layernorm"] == ("IdentityOp", ""), path
            tree[f"{path}.linear_kv_up_proj"] = ("TEColumnParallelLinear", "")
            tree[f"{path}.kv_layernorm"] = ("TENorm", "")
            layer = path.removesuffix(".self_attention")
            key = f"{layer}.sharded_state_dict_keys_map.self_attention.kv_layernorm."
            tree[key] = (repr("self_attention.linear_kv_up_proj.layer_norm_"), "")
    return tree


def without_core_attention(tree):
    return {path: module for path, module in tree.items() if "core_attention" not in path}


def compare_with_megatron(options, impl, before_each_build=lambda: None):
    """One combination through Megatron's builder and ours: (kind, detail, our tree). kind is "config refused"
    (megatron-core's config refuses it), "both refused" (detail: Megatron's error), "one refused" (detail: who and
    why) or "compared" (detail: the nodes where our tree and :func:`documented_2d_tree` of Megatron's differ)."""
    from megatron.training.models.gpt import GPTModelConfig, default_layer_spec

    from megatron_2d.megatron.spec import get_gpt_layer_spec_2d

    try:
        config = transformer_config(impl, options)
    except (ValueError, AssertionError, NotImplementedError) as error:
        return "config refused", str(error), None
    trees = []
    for builder in (lambda c: default_layer_spec(c, None), get_gpt_layer_spec_2d):
        before_each_build()
        try:
            trees.append(module_tree(builder(GPTModelConfig(transformer=config, vocab_size=128))))
        except Exception as error:  # noqa: BLE001  (which builder refuses what is the result)
            trees.append(error)
    theirs, mine = trees
    if isinstance(theirs, Exception) and isinstance(mine, Exception):
        return "both refused", repr(theirs), None
    if isinstance(theirs, Exception) or isinstance(mine, Exception):
        return "one refused", repr(("megatron", theirs) if isinstance(theirs, Exception) else ("ours", mine)), None
    expected = without_core_attention(documented_2d_tree(theirs, options, impl))
    return "compared", sorted(set(without_core_attention(mine).items()) ^ set(expected.items()))[:6], mine


def run_local_specs(rank, world):
    """Every local combination (OPTIONS x attention), without apex and with apex (its layer norm faked:
    megatron-core then picks it for LayerNorm models only, if the normalization reaches the spec): (counts,
    problems, core attentions, the name CoreAttention2D)."""
    import megatron.core.models.backends as backends
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_2d.megatron.core_attention import CoreAttention2D

    tg.init_parallel()
    counts, problems, cores = collections.Counter(), {}, set()
    for apex, options in itertools.product((False, True), combinations(LOCAL_OPTIONS)):
        norm = ApexFusedLayerNorm if apex else gpt_layer_specs.WrappedTorchNorm

        def reset_norm():  # megatron's RMSNorm branch overwrites the module global: reset it
            backends.LNImpl = gpt_layer_specs.LNImpl = norm

        kind, detail, mine = compare_with_megatron(options, "local", reset_norm)
        counts[kind] += 1
        if kind == "one refused" or (kind == "compared" and detail):
            problems[(apex, str(options))] = detail
        if kind == "compared":
            cores |= {name for path, (name, _) in mine.items() if path.endswith("core_attention")}
            counts["apex layer norm"] += (
                apex
                and options["normalization"] == "LayerNorm"
                and any(m[0] == ApexFusedLayerNorm.__qualname__ for m in mine.values())
            )
        if kind == "both refused":
            counts[detail] += 1
    return dict(counts), problems, sorted(cores), CoreAttention2D.__qualname__


MLA_WITH_QK_L2_NORM = "AssertionError('qk_l2_norm is not supported with MLA.')"


@pytest.mark.distributed
def test_local_specs_equal_megatrons_but_core_attention():
    counts, problems, cores, expected = run_on_ranks(1, run_local_specs)[0]
    assert not problems, problems
    assert cores == [expected]
    # 48 OPTIONS x 5 attentions, twice (without and with apex). Megatron refuses qk_l2_norm with MLA (4 attentions
    # x 16) except on its dense local route, which does not pass qk_l2_norm on; with apex, the 88 LayerNorm ones
    # use its layer norm.
    assert counts == {"compared": 2 * 176, "both refused": 2 * 64, MLA_WITH_QK_L2_NORM: 2 * 64, "apex layer norm": 88}


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


def run_transformer_engine_specs(rank, world):
    """With Transformer Engine's classes as named placeholders (megatron_2d_dev.te_spec_cpu): every GPT
    combination of TE_OPTIONS through both builders, by attention; Megatron's hybrid stack spec against ours; the
    ready GPT spec (no config) against Megatron's TE layer spec with its defaults."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_2d.megatron.hybrid_spec import get_hybrid_stack_spec_2d
    from megatron_2d.megatron.spec import get_gpt_layer_spec_2d
    from megatron_2d_dev.te_spec_cpu import te_spec_placeholders

    tg.init_parallel()
    out = {"gpt": collections.defaultdict(list)}
    with te_spec_placeholders():
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

        for options in combinations(TE_OPTIONS):
            kind, detail, mine = compare_with_megatron(options, "transformer_engine")
            names = sorted({name for name, _ in mine.values()}) if mine else []
            out["gpt"][options["attention"]].append((str(options), kind, detail, names))
        out["hybrid"] = (module_tree(hybrid_stack_spec, "stack"), module_tree(get_hybrid_stack_spec_2d(True), "stack"))
        out["ready"] = (module_tree(get_gpt_layer_with_transformer_engine_spec()), module_tree(get_gpt_layer_spec_2d()))
    return out


@pytest.fixture(scope="module")
def te_specs():
    return run_on_ranks(1, run_transformer_engine_specs, timeout_s=300)[0]


# per attention: (compared, refused by both builders) of its 192 combinations of TE_OPTIONS
TE_COUNTS = {"dense": (192, 0), "mla": (96, 96), "mla_latent": (96, 96), "mla_fused": (96, 96)}
TE_COUNTS["mla_fused_latent"] = TE_COUNTS["mla_latent"]
TE_MODULES = {  # modules each attention's trees must show, so that the comparison reaches them
    "dense": ["SelfAttention", "TELayerNormColumnParallelLinear", "TENorm", "L2Norm", "TEActivationOp", "TEFusedMLP"],
    "mla": ["MLASelfAttention", "TELayerNormColumnParallelLinear", "TEGroupedMLP", "TEColumnParallelGroupedLinear"],
    "mla_latent": ["MLASelfAttention2D", "TENorm", "TEColumnParallelLinear"],
    "mla_fused": ["FusedMLASelfAttention", "TEFusedMLPWithGroupedLinear"],
    "mla_fused_latent": ["FusedMLASelfAttention2D", "TENorm"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("attention", list(ATTENTION))
def test_transformer_engine_specs_equal_megatrons_but_documented_changes(te_specs, attention):
    """--transformer-impl transformer_engine, every combination of TE_OPTIONS for this attention: our spec is
    Megatron's TE spec but for core attention and (latent ring) the documented changes; a combination Megatron's
    builder refuses, ours refuses too (megatron-core's config accepts all 960)."""
    results = te_specs["gpt"][attention]
    problems = [(options, kind, detail) for options, kind, detail, _ in results if kind != "compared" or detail]
    problems = {str(detail): options for options, kind, detail in problems if detail != MLA_WITH_QK_L2_NORM}
    assert not problems, problems  # {each distinct problem: the first combination showing it}
    compared = sum(kind == "compared" for _, kind, _, _ in results)
    both_refused = sum(kind == "both refused" for _, kind, _, _ in results)
    assert (compared, both_refused) == TE_COUNTS[attention]
    seen = " ".join(" ".join(names) for *_, names in results)
    for module in TE_MODULES[attention] + ["CoreAttention2D"]:
        assert module in seen, module


@pytest.mark.distributed
def test_transformer_engine_hybrid_and_ready_specs_equal_megatrons(te_specs):
    """Megatron's hybrid stack spec (hybrid_layer_specs.hybrid_stack_spec, what --spec names on GPUs) against
    get_hybrid_stack_spec_2d(True): the stack class HybridStack2D and the attention layer's core attention differ,
    nothing else (Mamba, GDN, MLP, MoE, MLA and DSA layers and MTP stay Megatron's); and the ready GPT spec."""
    theirs, mine = te_specs["hybrid"]
    changed = {p for p in set(theirs) | set(mine) if theirs.get(p) != mine.get(p)}
    assert changed == {"stack", "stack.attention_layer.self_attention.core_attention"}, changed
    assert (theirs["stack"][0], mine["stack"][0]) == ("HybridStack", "HybridStack2D")
    assert mine["stack.attention_layer.self_attention.core_attention"][0] == "CoreAttention2D"
    assert theirs["stack.mamba_layer.mixer.in_proj"] == ("TELayerNormColumnParallelLinear", "")
    assert theirs["stack.mla_layer.self_attention.core_attention"] == ("TEDotProductAttention", "")
    theirs, mine = te_specs["ready"]
    assert without_core_attention(mine) == without_core_attention(theirs)
    assert theirs["layer.self_attention.linear_qkv"] == ("TELayerNormColumnParallelLinear", "")
    assert mine["layer.self_attention.core_attention"][0] == "CoreAttention2D"


def test_te_placeholders_are_named_and_everything_is_restored():
    """Inside te_spec_placeholders every TE class megatron-core left out is a named class in the extension module
    and in the spec modules that imported it (TESpecProvider bound where it was None, the hybrid spec rebuilt);
    afterwards every module reads what it read before."""
    import megatron.core.extensions.transformer_engine as te_ext
    import megatron.core.utils as mcore_utils
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.hybrid import hybrid_layer_specs
    from megatron.core.transformer.mlp import MLP

    from megatron_2d_dev.te_spec_cpu import te_spec_placeholders

    def snapshot():
        return {
            (name, key): id(value)
            for name, module in list(sys.modules.items())
            if name.split(".")[0] == "megatron" and module is not None
            for key, value in vars(module).items()
            if key.startswith("TE") or key in ("HAVE_TE", "hybrid_stack_spec", "_te_version")
        }

    before, spec_before = snapshot(), hybrid_layer_specs.hybrid_stack_spec
    if te_ext.HAVE_TE:  # Transformer Engine installed: nothing to stand in for
        with te_spec_placeholders() as rebound:
            assert rebound == {} and snapshot() == before
        return
    assert isinstance(te_ext.TELinear, mock.NonCallableMock) and gpt_layer_specs.TESpecProvider is None
    with te_spec_placeholders() as rebound:
        for name in ("TEFusedMLP", "TELinear", "TEColumnParallelGroupedLinear", "TEDotProductAttention"):
            value = getattr(te_ext, name)
            assert isinstance(value, type) and value.__name__ == name, (name, value)
        assert gpt_layer_specs.TEFusedMLP is te_ext.TEFusedMLP and issubclass(te_ext.TEFusedMLP, MLP)
        assert gpt_layer_specs.TESpecProvider is TESpecProvider
        assert te_ext.HAVE_TE and mcore_utils.is_te_min_version("1.13.0")
        qkv = hybrid_layer_specs.hybrid_stack_spec.submodules.attention_layer.submodules.self_attention
        assert qkv.submodules.linear_qkv is te_ext.TELayerNormColumnParallelLinear
        assert hybrid_layer_specs.hybrid_stack_spec is not spec_before
    assert {"megatron.core.models.gpt.gpt_layer_specs", "megatron.core.models.backends"} <= set(rebound)
    assert snapshot() == before
    assert hybrid_layer_specs.hybrid_stack_spec is spec_before and not mcore_utils.is_te_min_version("1.0")
