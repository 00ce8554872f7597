"""Generated Megatron configurations (megatron_2d_dev.generated_configs) trained on forked CPU ranks against
their CP=1 reference (megatron_2d_dev.config_runs): a fixed budget in CI, the regression draws of the defects
the generator found, the launch checks it made necessary, and the generator's coverage (no training).
``make fuzz-megatron`` runs as many draws as asked; a failure names its replay command."""

from __future__ import annotations

import collections
import functools
from dataclasses import replace
from types import SimpleNamespace

import pytest

from megatron_2d_dev.config_models import megatron_flags, parse_megatron_flags
from megatron_2d_dev.config_runs import run_configuration
from megatron_2d_dev.generated_configs import (
    DRAWS_PER_SCENARIO,
    LAUNCH,
    REFUSALS,
    SKIPS,
    ci_seeds,
    draw_config,
    expected_refusals,
    missing_corners,
    reference_of,
    scenario_draws,
    skip_reason,
)
from megatron_2d_dev.hybrid_cpu import install_hybrid_cpu_shims

install_hybrid_cpu_shims()

CI_SEEDS = ci_seeds()  # 8 scenarios x 3 draws = 24 draws
CI_DRAWS = [(seed, index) for seed in CI_SEEDS for index in range(DRAWS_PER_SCENARIO)]
COVERAGE_SEEDS = range(300)


@pytest.fixture(scope="module")
def references():
    """The CP=1 references, computed once per (scenario, reference TP) for the whole module."""
    return {}


def _assert_as_expected(outcome) -> None:
    assert outcome.status in ("pass", "refused", "skipped"), outcome.line()


@pytest.mark.megatron
@pytest.mark.distributed
@pytest.mark.parametrize("seed, index", CI_DRAWS, ids=[f"draw{s}:{i}" for s, i in CI_DRAWS])
def test_generated_configuration_trains_as_at_cp1(seed, index, references):
    """The loss and the gradient norm of every iteration, the parameters' names and shapes, and every gradient at
    iteration 1 equal the CP=1 reference's; or the draw is refused on every rank with its rule's message; or it is
    skipped by a named rule (counted in test_the_ci_budget_trains_most_of_its_draws)."""
    outcome = run_configuration(draw_config(seed, index), references)
    print(outcome.line())
    _assert_as_expected(outcome)


def test_the_ci_budget_trains_most_of_its_draws(capsys):
    """The fixed budget: 24 draws, most of them trained (refusals and skips counted and printed by rule)."""
    draws = [draw_config(s, i) for s, i in CI_DRAWS]
    counts = collections.Counter(
        f"skipped {skip_reason(d).name}"
        if skip_reason(d)
        else (f"refused {expected_refusals(d)[0].name}" if expected_refusals(d) else "trains")
        for d in draws
    )
    with capsys.disabled():
        print(f"\nCI draws (scenarios {CI_SEEDS}): " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    assert len(draws) == 24 and counts["trains"] >= 18, counts


# ---- the generator --------------------------------------------------------------------------------------------------
def test_the_generator_draws_every_corner():
    """Over 300 scenarios (900 draws, no training) every axis takes every value it has, among them the corners
    hand-picked tests miss: a pipeline stage without attention, a double ring, CP ranks strided over DP, K/V
    replication, a CP rank that holds only padding, one-token documents, end padding, every state and recompute
    mode. A change to the generator that loses one fails here."""
    draws = [d for seed in COVERAGE_SEEDS for d in scenario_draws(seed)]
    assert not missing_corners(draws)


def test_every_rule_is_drawn_and_most_draws_train():
    """Every refusal and skip rule applies to some draw over the coverage seeds (a rule nothing reaches is dead
    code), and most draws train."""
    draws = [d for seed in COVERAGE_SEEDS for d in scenario_draws(seed)]
    refused = {r.name for d in draws for r in expected_refusals(d)}
    skipped = {skip_reason(d).name for d in draws if skip_reason(d)}
    assert refused == {r.name for r in REFUSALS} and skipped == {r.name for r in SKIPS}
    trains = [d for d in draws if not expected_refusals(d) and not skip_reason(d)]
    assert len(trains) >= 0.55 * len(draws), (len(trains), len(draws))


def test_draws_are_a_function_of_their_seed():
    assert draw_config(7, 1) == draw_config(7, 1) and draw_config(7, 1) != draw_config(7, 2)
    assert draw_config(7, 1).replay() == "python tools/fuzz_megatron.py --replay 7:1"


def test_draws_of_a_scenario_share_their_reference():
    """Draws share their scenario's reference by (reference TP, SP): a sequence-parallel draw's is at its own TP
    with SP (scenario 11: two draws at TP 1 share the TP = 1 reference, one at TP 2 with SP has its own)."""
    draws = scenario_draws(11)
    assert [(d.tp, d.sequence_parallel) for d in draws] == [(1, False), (1, False), (2, True)]
    assert reference_of(draws[0]) == reference_of(draws[1]) != reference_of(draws[2])
    for d in draws:
        ref = reference_of(d)
        assert ref.context_parallel_size == 1 and ref.dp == 1 and ref.sequence_parallel == d.sequence_parallel
        assert ref.tp == (d.tp if d.sequence_parallel else 1)


# ---- the launch checks the generator made necessary (no ranks: the parsed flags of a draw) --------------------------
def _launch_problem(seed, index):
    return _launch_problem_of(draw_config(seed, index))


def _launch_problem_of(draw, *extra_flags):
    """check_launch_args' refusal of ``draw``'s pretrain flags (with ``extra_flags`` after them), or None."""
    from megatron_2d.megatron.launch_checks import check_launch_args

    try:
        check_launch_args(parse_megatron_flags(megatron_flags(draw) + list(extra_flags)))
    except ValueError as err:
        return str(err)
    return None


@functools.cache
def _coverage_draws():
    return [d for seed in COVERAGE_SEEDS for d in scenario_draws(seed)]


def _draw_refused_by(rule):
    """The first coverage draw ``rule`` applies to: one it alone refuses where the coverage seeds hold one."""
    draws = [d for d in _coverage_draws() if rule in expected_refusals(d)]
    alone = [d for d in draws if expected_refusals(d) == [rule]]
    return (alone or draws)[0]


@pytest.mark.megatron
@pytest.mark.parametrize("rule", REFUSALS, ids=[r.name for r in REFUSALS])
def test_every_refusal_fires_in_the_launch_checks(rule):
    """The refusal table says where each rule fires (``fires_at``): every one in the launch checks, on every rank
    before Megatron's process groups or any collective (config_runs checks each refused draw's ranks came back from
    there). Fed the flags of a draw the rule applies to, check_launch_args raises with the rule's message (with
    another applicable rule's where no coverage draw has this one alone)."""
    assert rule.fires_at == LAUNCH
    draw = _draw_refused_by(rule)
    problem = _launch_problem_of(draw)
    assert problem is not None, f"{rule.name}: the launch checks passed {draw.replay()}"
    rules = [rule] if expected_refusals(draw) == [rule] else expected_refusals(draw)
    assert any(r.message in problem for r in rules), (rule.name, draw.replay(), problem)


@pytest.mark.megatron
def test_the_four_late_refusals_fire_at_launch_and_name_what_works():
    """The refusals that fired after Megatron's process groups (in TransformerConfig2D, the GPT spec, Hybrid ZeRO's
    optimizer config) fire in the launch checks, each naming the flags and what works; the flags that work pass."""
    hp = _draw_refused_by(next(r for r in REFUSALS if r.name == "hp_does_not_divide_heads"))
    assert expected_refusals(hp) == [REFUSALS[0]]
    problem = _launch_problem_of(hp)
    heads = hp.scenario.heads // hp.tp
    assert f"head-parallel size {hp.hp} does not divide the {heads} attention heads per tensor-parallel rank" in problem
    assert "valid head-parallel sizes for context_parallel_size" in problem
    cases = {
        "sequence_split_with_mla": (["--sft"], "use --sft batches"),
        "documents_layout_with_mla": (["--cp-2d-packing", "zigzag", "--sft"], "use cp_2d_packing='zigzag'"),
        "hybrid_zero_wider_optimizer_shard_with_clipping": (["--clip-grad", "0.0"], "add --clip-grad 0.0"),
    }
    for name, (fix, what_works) in cases.items():
        rule = next(r for r in REFUSALS if r.name == name)
        draw = _draw_refused_by(rule)
        if expected_refusals(draw) != [rule]:  # documents + MLA is drawn with SP only (refused first for SP)
            draw = replace(draw, sequence_parallel=False)
        assert expected_refusals(draw) == [rule], (name, draw.describe())
        problem = _launch_problem_of(draw)
        assert problem is not None and rule.message in problem and what_works in problem, (name, problem)
        assert _launch_problem_of(draw, *fix) is None, (name, draw.replay())
    wider = _draw_refused_by(REFUSALS[-1])
    assert "--clip-grad 1.0 with --outer-dp-sharding-strategy optim" in _launch_problem_of(wider)


@pytest.mark.megatron
def test_launch_checks_pass_the_draws_that_train():
    """The launch checks refuse nothing the generator expects to train (over the CI draws)."""
    for seed, index in CI_DRAWS:
        draw = draw_config(seed, index)
        if not expected_refusals(draw) and not skip_reason(draw):
            assert _launch_problem(seed, index) is None, draw.describe()


def test_documents_layout_refuses_pipeline_parallelism_in_the_config():
    """TransformerConfig2D refuses cp_2d_packing='documents' with PP > 1 (every rank builds the config)."""
    from megatron_2d.megatron.launch_checks import documents_layout_problem

    config = SimpleNamespace(cp_2d_packing="documents", context_parallel_size=4, pipeline_model_parallel_size=2)
    assert "runs with pipeline_model_parallel_size 1 only, not 2" in documents_layout_problem(config)
    assert documents_layout_problem(SimpleNamespace(**{**vars(config), "pipeline_model_parallel_size": 1})) is None
    assert documents_layout_problem(SimpleNamespace(**{**vars(config), "cp_2d_packing": "zigzag"})) is None


# ---- regressions: one draw per defect the generator found (each failed before its fix) ------------------------------
def _draw(seed, index, **expected):
    """Draw ``seed:index``, checked to still be the configuration the regression is about (a change to the generator
    that moves it fails here, naming the draw to pick again). QK-clip, drawn from a stream of its own after these
    regressions were found, is held off unless ``qk_clip`` is expected (``draw_config(qk_clip=False)``)."""
    draw = draw_config(seed, index, qk_clip="qk_clip" in expected)
    values = {**vars(draw.scenario), **{k: getattr(draw, k) for k in ("tp", "pp", "state", "zero_states", "order")}}
    values["reference_tp"] = reference_of(draw).tp
    values["refusals"] = [r.name for r in expected_refusals(draw)]
    wrong = {k: (values[k], v) for k, v in expected.items() if values[k] != v}
    assert not wrong, f"draw {seed}:{index} is no longer the regression's configuration: {wrong}"
    return draw


def _refused_by(outcome, rule: str) -> None:
    assert outcome.status == "refused" and outcome.detail.startswith(rule + ":"), outcome.line()


@pytest.mark.megatron
@pytest.mark.distributed
def test_draw_60_1_learnable_sinks_at_tp2_are_a_tensor_parallel_parameter(references):
    """Learnable sinks at TP 2: CoreAttention2D marks ``softmax_offset`` tensor-parallel along its heads, so the
    gradient norm counts every TP rank's heads and layout-independent weights split it like the heads. Before, it was
    unmarked (as in megatron-core's DotProductAttention): its full shape read (4,) instead of (8,), and the losses
    and gradient norms differed from the TP=1 reference from iteration 1 (draw 110:0 then, which now runs sequence
    parallelism and is compared at TP 2)."""
    draw = _draw(60, 1, softmax_type="learnable", tp=2, reference_tp=1, refusals=[])
    outcome = run_configuration(draw, references)
    assert outcome.status == "pass", outcome.line()


@pytest.mark.megatron
@pytest.mark.distributed
def test_draw_330_0_hybrid_model_under_the_per_sequence_split_trains(references):
    """HybridModel with Megatron's per-sequence split of packed documents (--dataloader-inter-document-masking) at
    CP > 1: HybridStack2D gives its attention layer SelfAttention2D (RoPE at document positions), as the GPT spec
    does. Before, Megatron's THD RoPE raised inside the first forward (split_with_sizes of the per-document split)."""
    draw = _draw(330, 0, model="hybrid", data="sequence", refusals=[])
    assert not set(draw.scenario.layers) & set("MG")
    outcome = run_configuration(draw, references)
    assert outcome.status == "pass", outcome.line()


@pytest.mark.megatron
@pytest.mark.distributed
def test_draw_6_0_documents_layout_with_yarn_trains(references):
    """The documents layout with YaRN (--position-embedding-type yarn): use_document_positions reads YaRN's table at
    document positions (its (table, mscale) pair kept). Before, it raised in the first forward ("supports RoPE
    models"; draw 113:2 then, which now runs sequence parallelism and is refused)."""
    draw = _draw(6, 0, data="documents", position="yarn", refusals=[])
    outcome = run_configuration(draw, references)
    assert outcome.status == "pass", outcome.line()


@pytest.mark.megatron
@pytest.mark.distributed
@pytest.mark.parametrize(
    "seed, index, dtype",
    [(3032, 1, "fp32"), (3020, 0, "bf16"), (3045, 0, "bf16")],
    ids=["draw3032:1_fp32", "draw3020:0_bf16", "draw3045:0_bf16"],
)
def test_draw_trains_within_its_perturbed_twins_floor(seed, index, dtype, references):
    """Models that amplify rounding (3032 and 3020: hybrid '*E-M', whose Mamba gated RMSNorm meets a near-zero
    group; 3045: qk_layernorm weights in bf16) pass on the floor their perturbed twin measures (the reference with
    every parameter moved one rounding step), not on a looser table. Before the twin, 3032:1 failed the fp32
    iteration-1 grad norm bound and 3020:0 / 3045:0 the bf16 gradient bound; two CP=1 core attentions (Megatron's
    and ReferenceCoreAttention) differ as much on 3032. Measurements: docs/testing.md."""
    draw = _draw(seed, index, dtype=dtype, refusals=[])
    # the model they were found on: LayerNorm, as every GPT and hybrid scenario had before the normalization axis,
    # and plain top-k routing, as every MoE scenario had before the router axis
    draw = replace(draw, scenario=replace(draw.scenario, normalization="LayerNorm", moe_router="plain"))
    outcome = run_configuration(draw, references)
    assert outcome.status == "pass", outcome.line()
    assert outcome.errors["floored"] == 1.0, outcome.errors  # the table alone would fail it: the floor is needed


REFUSED_DRAWS = [
    # (seed, index, rule, what the draw did before its refusal)
    (
        1,
        1,
        "partial_distributed_optimizer_with_pipeline_and_aligned_grad_reduce",
        "trained with the first iteration's gradients reduced twice (grad norm about twice the reference's)",
    ),
    (
        24,
        0,
        "documents_layout_with_pipeline",
        "a RuntimeError in Megatron's THD RoPE (split_with_sizes) in the first forward",
    ),
    (18, 1, "megatron_fsdp_with_pipeline", "an einops error from megatron-fsdp's device mesh at wrapping"),
    (109, 2, "tp_pp_dp_mapping_with_context_and_pipeline", "an AssertionError in initialize_model_parallel"),
    (
        113,
        2,
        "documents_layout_with_sequence_parallelism",
        "trained as at CP=1 with the check off (its slot counts happened to divide by TP); the layout does not "
        "ensure that, and Megatron's sequence-parallel split needs it",
    ),
    (385, 2, "documents_layout_with_mla", "raised in the first forward ('supports RoPE models'; draw 208:0 then)"),
    # the refusals that came after Megatron's process groups (issue 45), now in the launch checks
    (8, 2, "hp_does_not_divide_heads", "refused by TransformerConfig2D, after Megatron's process groups"),
    (0, 0, "sequence_split_with_mla", "refused by MLATransformerConfig2D, after Megatron's process groups"),
    (
        29,
        1,
        "hybrid_zero_wider_optimizer_shard_with_clipping",
        "refused by Hybrid ZeRO's optimizer_config, after the model and DDP were built",
    ),
]


@pytest.mark.megatron
@pytest.mark.distributed
@pytest.mark.parametrize(
    "seed, index, rule, before", REFUSED_DRAWS, ids=[f"draw{s}:{i}_{rule}" for s, i, rule, _ in REFUSED_DRAWS]
)
def test_draw_is_refused_on_every_rank_before_it_runs(seed, index, rule, before, references):
    """Compositions that cannot run are refused by the launch checks (and the config, where it knows them), on every
    rank before any model is built, naming the settings and what works; ``before`` says what happened before."""
    draw = _draw_1_1() if (seed, index) == (1, 1) else _draw(seed, index, refusals=[rule])
    _refused_by(run_configuration(draw, references), rule)


def _draw_1_1():
    """Draw 1:1 as it was found, at EP 1: expert parallelism (drawn later, from its own stream) gives it EP 2, which
    the skip rule partial_distributed_optimizer_with_experts_and_cp_strided_over_dp then takes first."""
    draw = _draw(1, 1, refusals=["partial_distributed_optimizer_with_pipeline_and_aligned_grad_reduce"])
    return replace(draw, ep=1)


@pytest.mark.megatron
@pytest.mark.distributed
def test_draw_1_1_megatron_still_reduces_the_first_gradients_twice(references, monkeypatch):
    """Why draw 1:1 is refused: without the launch check it trains, and megatron-core 0.19.2 (partial distributed
    optimizer, --overlap-grad-reduce, --align-grad-reduce, PP 2) reduces iteration 1's gradients twice. When this
    test fails, megatron-core fixed it and the refusal can go."""
    from megatron_2d.megatron import launch_checks

    draw = _draw_1_1()
    monkeypatch.setattr(launch_checks, "megatron_composition_problems", lambda args: [])  # inherited by the forks
    monkeypatch.setattr("megatron_2d_dev.config_runs.expected_refusals", lambda d: [])  # let the draw train and compare
    outcome = run_configuration(draw, references)
    assert outcome.status == "fail" and "grad norm" in outcome.detail, outcome.line()
    assert outcome.errors["grad_norm_1"] > 0.5, outcome.errors  # about twice the reference's norm
