"""Train one generated Megatron configuration (:mod:`megatron_2d_dev.generated_configs`) on forked CPU ranks and
compare it with its CP = 1 reference.

On every rank, in this order: the launch checks on the draw's pretrain_gpt.py / pretrain_hybrid.py flags (parsed
by Megatron-LM's own parser in the parent), Megatron's parallel state, the model config (TransformerConfig2D
validates), the model chunks (the 2d specs build the 2D groups), Float16Module for bf16, DDP or megatron-fsdp, the
optimizer (Hybrid ZeRO's choice); a ValueError up to there is the draw's refusal, returned by every rank with where
it came (``refused_at``: "launch" from the launch checks, "setup" after them), which must be its rule's
``fires_at``. Then
``ITERATIONS`` Adam steps through Megatron's schedule (``get_forward_backward_func``, ``finalize_model_grads``,
``optimizer.step()``) on the scenario's batches (this DP rank's share, in micro-batches, split over CP as the
draw's data path splits them). Per iteration: the loss and the gradient norm the optimizer computes; the
parameters' canonical names and full shapes; after iteration 1's reduction, every gradient at its full shape. With
QK-clip (the scenario's ``qk_clip``), after every ``optimizer.step()`` the clip step of Megatron-LM's training loop
(:func:`megatron_2d.megatron.qk_clip.clip_qk`, which runs megatron-core's own on each attention layer), whose
logged max logit is kept per iteration, and after the last iteration every weight at its full shape (Megatron's DDP
and distributed optimizer; megatron-fsdp's sharded weights are compared through the losses).

The reference is the same function on :func:`generated_configs.reference_of`'s draw (CP = 1, one rank unless MLA's
TP), with Megatron's own core attention or :class:`.reference_core_attention.ReferenceCoreAttention`. What it
trains is :mod:`.config_models`, on the batches of :mod:`.config_data`.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_2d.testing.distributed import RankFailure, run_on_ranks
from megatron_2d.testing.reference import TOLERANCES

from . import ddp_harness as mcpu
from . import tiny_gpt as tg
from .config_data import dynamic_forward_step, dynamic_samples, forward_step, microbatches
from .config_models import (
    DTYPES,
    OPTIMIZER,
    build_chunks,
    ddp_extra,
    hybrid_zero,
    megatron_flags,
    parse_megatron_flags,
    tiny_config,
)
from .generated_configs import (
    ITERATIONS,
    LAUNCH,
    Draw,
    expected_refusals,
    norm_route,
    perturbed_twin_of,
    reference_of,
    skip_reason,
)


# ---- one run on one rank ---------------------------------------------------------------------------------------------
@dataclass
class RankResult:
    refused: str | None = None
    refused_at: str | None = None  # generated_configs.LAUNCH (the launch checks) or SETUP (after them)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] | None = None  # rank 0 only
    max_logits: list[float] = field(default_factory=list)  # QK-clip: each iteration's logged max, over all ranks
    weights: dict[str, torch.Tensor] | None = None  # QK-clip: after the last iteration, rank 0 only
    seconds: float = 0.0


SETUP = "setup"
"""Where a refusal came when the launch checks passed: Megatron's parallel state, the config, the model, DDP or the
optimizer (:func:`_setup`)."""


def _setup(draw: Draw):
    """Everything before training after the launch checks, on this rank: a ValueError here is a refusal at
    :data:`SETUP`."""
    from .ddp_harness import init_parallel

    hz = hybrid_zero(draw)
    CP = draw.context_parallel_size
    init_parallel(
        tensor_model_parallel_size=draw.tp,
        pipeline_model_parallel_size=draw.pp,
        context_parallel_size=CP,
        virtual_pipeline_model_parallel_size=draw.vpp,
        order=draw.order,
        seed=draw.scenario.seed,
        expert_model_parallel_size=draw.ep,
        **({"hybrid_context_parallel": True} if draw.dynamic else {}),
        **hz.initialize_model_parallel_kwargs(draw.dp, CP),
    )
    cfg = tiny_config(draw)
    chunks = build_chunks(draw, cfg)
    if draw.perturbed:
        _perturb(chunks, draw.scenario.seed)
    shapes = {}
    for chunk in chunks:
        shapes.update(tg.full_shapes(chunk))
    if draw.scenario.dtype == "bf16":
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    from megatron_2d.megatron.hybrid_zero import distributed_data_parallel_config, optimizer_config

    wrapped = mcpu.wrap_chunks(chunks, distributed_data_parallel_config(hz, draw.dp, CP, **ddp_extra(draw, hz)))
    dtype = DTYPES[draw.scenario.dtype]
    config = optimizer_config(hz, draw.dp, CP, **OPTIMIZER, bf16=dtype == torch.bfloat16, params_dtype=dtype)
    return wrapped, mcpu.build_optimizer(wrapped, config), tg.merge_over_expert_parallel(tg.merge_over_pipeline(shapes))


def _perturb(chunks: list[torch.nn.Module], seed: int) -> None:
    """Every parameter times (1 +- its dtype's eps), the signs seeded: one rounding step (before any wrapper copies
    the parameters into buffers or main parameters)."""
    g = torch.Generator().manual_seed(seed)
    for chunk in chunks:
        for param in chunk.parameters():
            signs = torch.randint(0, 2, param.shape, generator=g).to(param.dtype) * 2 - 1
            param.data.mul_(1 + signs * torch.finfo(param.dtype).eps)


def train_draw(rank: int, world: int, draw: Draw, launch_args) -> RankResult:
    """Run ``draw`` on this rank (see the module docstring)."""
    from megatron.core import parallel_state

    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    mcpu.install_megatron_ddp_cpu_shims()  # before the model: MoE's all-to-all dispatcher makes a CUDA stream
    start = time.perf_counter()
    from megatron_2d.megatron.launch_checks import check_launch_args

    try:
        check_launch_args(launch_args)
    except ValueError as err:
        return RankResult(refused=str(err), refused_at=LAUNCH)
    try:
        wrapped, optimizer, shapes = _setup(draw)
    except ValueError as err:
        return RankResult(refused=str(err), refused_at=SETUP)
    result = RankResult(shapes=shapes)
    step_func = functools.partial(dynamic_forward_step if draw.dynamic else forward_step, draw)
    for iteration in range(ITERATIONS):
        data_iterator = None
        if draw.dynamic:  # Megatron's hybrid data wrapper over this DP rank's packed sequences
            from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper

            batches = dynamic_samples(draw, iteration)
            seq_length = max(int(b["cu_seqlens"][-1]) for b in batches)
            data_iterator = iter(HybridCPDataLoaderWrapper(iter([batches]), mcpu.unwrapped(wrapped[0]).config))
        else:
            batches, seq_length = microbatches(draw, iteration)
        grads: dict[str, torch.Tensor] = {}

        def keep_gradients(grads=grads):
            grads.update(mcpu.full_gradients(wrapped))

        reports, grad_norm = mcpu.schedule_step(
            wrapped,
            optimizer,
            step_func,
            batches,
            seq_length,
            micro_batch_size=draw.micro_batch_size,
            before_step=keep_gradients if iteration == 0 else None,
            data_iterator=data_iterator,
        )
        totals = torch.zeros(2, dtype=torch.float64)  # (sum of masked per-token loss, loss tokens)
        for report in reports:
            totals[0] += float(report["local_sum"])
        for item in batches:
            mask = item["loss_mask"] if isinstance(item, dict) else item.batch["loss_mask"]
            totals[1] += float(mask.sum()) / draw.context_parallel_size  # every CP rank counts its share once
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        if not parallel_state.is_pipeline_last_stage():
            totals[0] = 0.0
        dist.all_reduce(totals[:1], group=parallel_state.get_pipeline_model_parallel_group())
        result.losses.append(float(totals[0] / totals[1]))
        result.grad_norms.append(grad_norm)
        if iteration == 0 and rank == 0:
            result.grads = grads
        if draw.scenario.qk_clip:
            result.max_logits.append(_clip(wrapped))
    if draw.scenario.qk_clip and not draw.megatron_fsdp:
        weights = mcpu.full_weights(wrapped)
        result.weights = weights if rank == 0 else None
    result.seconds = time.perf_counter() - start
    return result


def _clip(chunks) -> float:
    """The training loop's QK-clip step after ``optimizer.step()``; its logged max logit over every rank (each TP
    rank and pipeline stage logs its own heads' and layers')."""
    from megatron_2d.megatron.qk_clip import clip_qk

    logged = torch.tensor([clip_qk(chunks)], dtype=torch.float64)
    dist.all_reduce(logged, op=dist.ReduceOp.MAX)
    return float(logged)


# ---- a draw against its reference ------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one draw did: 'pass', 'refused' (as expected), 'skipped', or 'fail' with the problems."""

    draw: Draw
    status: str
    detail: str = ""
    seconds: float = 0.0
    errors: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status.upper()} {self.detail} | {self.draw.describe()} | replay: {self.draw.replay()}"


def _launch(draw: Draw, timeout_s: float) -> list[RankResult]:
    return run_on_ranks(draw.world, train_draw, draw, parse_megatron_flags(megatron_flags(draw)), timeout_s=timeout_s)


def errors_against(got: list[RankResult], expected: RankResult) -> dict[str, float]:
    """The largest relative errors of a run against its reference: ``loss`` and ``grad_norm`` (every iteration,
    every rank; ``grad_norm_1`` iteration 1's), ``grad`` (iteration 1, max |error| / max |reference| per tensor)
    and ``grad_l2`` (||error|| / ||reference|| per tensor)."""
    worst = {"loss": 0.0, "grad_norm_1": 0.0, "grad_norm": 0.0, "grad": 0.0, "grad_l2": 0.0}
    if expected.max_logits:
        worst["max_logit"] = max(_relative(a, e) for r in got for a, e in zip(r.max_logits, expected.max_logits))
    if expected.weights and got[0].weights:
        worst["weights"] = max(
            tg.max_relative_error(got[0].weights[n].double(), w.double()) if n in got[0].weights else float("inf")
            for n, w in expected.weights.items()
        )
    for r in got:
        for a, e in zip(r.losses, expected.losses):
            worst["loss"] = max(worst["loss"], abs(a - e) / abs(e))
        for it, (a, e) in enumerate(zip(r.grad_norms, expected.grad_norms)):
            err = float("inf") if a is None else abs(a - e) / abs(e)
            worst["grad_norm"] = max(worst["grad_norm"], err)
            if it == 0:
                worst["grad_norm_1"] = max(worst["grad_norm_1"], err)
    for name, want in expected.grads.items():
        have = got[0].grads.get(name)
        if have is None or have.shape != want.shape:
            worst["grad"] = worst["grad_l2"] = float("inf")
            continue
        worst["grad"] = max(worst["grad"], tg.max_relative_error(have.double(), want.double()))
        scale = want.double().norm().item()
        worst["grad_l2"] = max(worst["grad_l2"], (have.double() - want.double()).norm().item() / (scale or 1.0))
    return worst


SPREAD_FACTOR = 4
"""A draw may differ from its reference by this multiple of the reference's own spread under a one-step rounding
perturbation (:func:`generated_configs.perturbed_twin_of`) where that exceeds the table's bound; measured ratios in
docs/testing.md."""


FLOOR_CAP = 10
"""The twin's floor is at most this multiple of the table's bound: where the twin moves a quantity further (some
bf16 gradients; docs/testing.md), the draw is compared at the cap, not at a bound that cannot fail."""


def _relative(a: float | None, e: float) -> float:
    return float("inf") if a is None else abs(a - e) / abs(e)


def _bound(table: float, twin_spread: float) -> float:
    """The table's bound, or SPREAD_FACTOR times the twin's spread up to FLOOR_CAP times the table's."""
    return max(table, min(SPREAD_FACTOR * twin_spread, FLOOR_CAP * table))


def compare(draw: Draw, got: list[RankResult], expected: RankResult, twin: RankResult) -> list[str]:
    """Problems of ``draw``'s results against its reference's (empty: it trains as at CP = 1): within the dtype's
    bounds of :data:`megatron_2d.testing.reference.TOLERANCES` (``training``), or within ``SPREAD_FACTOR`` times the
    perturbed twin's distance from the reference (``twin``) up to ``FLOOR_CAP`` times the table's, whichever is
    larger, quantity by quantity."""
    tol = TOLERANCES[DTYPES[draw.scenario.dtype]].training
    problems = []
    first = got[0]
    if first.shapes != expected.shapes:
        missing = sorted(set(expected.shapes) - set(first.shapes))
        extra = sorted(set(first.shapes) - set(expected.shapes))
        differ = {
            n: (first.shapes[n], s) for n, s in expected.shapes.items() if n in first.shapes and first.shapes[n] != s
        }
        problems.append(f"parameters differ: missing {missing}, extra {extra}, shapes (got, want) {differ}")
    for it, (e_loss, e_norm) in enumerate(zip(expected.losses, expected.grad_norms), start=1):
        loss_bound = _bound(tol.loss, _relative(twin.losses[it - 1], e_loss))
        norm_bound = _bound(
            tol.grad_norm if it == 1 else tol.later_grad_norm, _relative(twin.grad_norms[it - 1], e_norm)
        )
        for rank, r in enumerate(got):
            loss, norm = r.losses[it - 1], r.grad_norms[it - 1]
            if not _relative(loss, e_loss) <= loss_bound:
                problems.append(f"iteration {it} rank {rank}: loss {loss:.9g} vs {e_loss:.9g} (bound {loss_bound:.2g})")
            if not _relative(norm, e_norm) <= norm_bound:
                problems.append(
                    f"iteration {it} rank {rank}: grad norm {norm} vs {e_norm:.9g} (bound {norm_bound:.2g})"
                )
    bad = {}
    for name, want in expected.grads.items():
        have = first.grads.get(name)
        if have is None or have.shape != want.shape:
            bad[name] = "missing" if have is None else f"shape {tuple(have.shape)}"
            continue
        err = tg.max_relative_error(have.double(), want.double())
        bound = _bound(tol.grad, tg.max_relative_error(twin.grads[name].double(), want.double()))
        if not err <= bound:
            bad[name] = f"{err:.2e} (bound {bound:.2g})"
    if bad:
        problems.append(f"iteration 1 gradients off (table bound {tol.grad:g}, or the twin's floor): {bad}")
    if draw.scenario.qk_clip:
        problems += _qk_clip_problems(got, expected, twin, tol)
    return problems


def _qk_clip_problems(got: list[RankResult], expected: RankResult, twin: RankResult, tol) -> list[str]:
    """QK-clip's checks (see :func:`compare`): the reference clipped (its first max logit is above the threshold),
    each iteration's logged max logit, and every weight after the last iteration."""
    from .generated_configs import QK_CLIP_THRESHOLD

    problems = []
    if not (expected.max_logits and expected.max_logits[0] > QK_CLIP_THRESHOLD):
        problems.append(
            f"the reference's max logits {expected.max_logits} never exceed the QK-clip threshold "
            f"{QK_CLIP_THRESHOLD}: the clip did not act, so the draw would check nothing"
        )
    for it, e in enumerate(expected.max_logits):
        bound = _bound(tol.grad_norm if it == 0 else tol.later_grad_norm, _relative(twin.max_logits[it], e))
        for rank, r in enumerate(got):
            if len(r.max_logits) != len(expected.max_logits) or not _relative(r.max_logits[it], e) <= bound:
                problems.append(
                    f"iteration {it + 1} rank {rank}: max logits {r.max_logits} vs {e:.9g} (bound {bound:.2g})"
                )
    if expected.weights is not None and got[0].weights is not None:
        bad = {}
        for name, want in expected.weights.items():
            have = got[0].weights.get(name)
            if have is None or have.shape != want.shape:
                bad[name] = "missing" if have is None else f"shape {tuple(have.shape)}"
                continue
            err = tg.max_relative_error(have.double(), want.double())
            bound = _bound(tol.weights, tg.max_relative_error(twin.weights[name].double(), want.double()))
            if not err <= bound:
                bad[name] = f"{err:.2e} (bound {bound:.2g})"
        if bad:
            problems.append(f"weights after the last iteration off (table bound {tol.weights:g}): {bad}")
    return problems


def run_configuration(
    draw: Draw, references: dict | None = None, timeout_s: float = 240, with_twin: bool = True
) -> Outcome:
    """Run ``draw`` and compare it with its reference (computed once per reference draw, kept in
    ``references``); the ranks are forked inside the draw's norm route (:func:`generated_configs.norm_route`), which
    its reference shares; ``with_twin`` False: at the table's bounds alone, without the perturbed twin's floor (and
    its run)."""
    skip = skip_reason(draw)
    if skip is not None:
        return Outcome(draw, "skipped", f"{skip.name}: {skip.message}")
    from .sp_norms import norm_route as norms

    with norms(norm_route(draw)):
        return _run_and_compare(draw, references, timeout_s, with_twin)


def _run_and_compare(draw: Draw, references: dict | None, timeout_s: float, with_twin: bool) -> Outcome:
    start = time.perf_counter()
    refusals = expected_refusals(draw)
    try:
        got = _launch(draw, timeout_s)
    except RankFailure as err:
        return Outcome(draw, "fail", f"raised: {err}", time.perf_counter() - start)
    refused = [r.refused for r in got]
    if refusals:
        matched = [next((r for r in refusals if m is not None and r.message in m), None) for m in refused]
        if all(matched) and len({r.name for r in matched}) == 1:
            where = {r.refused_at for r in got}
            if where != {matched[0].fires_at}:
                detail = f"{matched[0].name} refused at {sorted(where)}, not at {matched[0].fires_at}: {refused[0]}"
                return Outcome(draw, "fail", detail, time.perf_counter() - start)
            detail = f"{matched[0].name}: {refused[0].splitlines()[0]}"
            return Outcome(draw, "refused", detail, time.perf_counter() - start)
        names = [rule.name for rule in refusals]
        detail = f"expected refusal {names} on every rank, got {refused}"
        return Outcome(draw, "fail", detail, time.perf_counter() - start)
    if any(m is not None for m in refused):
        return Outcome(draw, "fail", f"refused unexpectedly: {refused}", time.perf_counter() - start)
    reference = reference_of(draw)
    references = {} if references is None else references
    if reference not in references:
        try:
            references[reference] = _launch(reference, timeout_s)[0]
        except RankFailure as err:
            return Outcome(draw, "fail", f"reference raised: {err}", time.perf_counter() - start)
    twin = perturbed_twin_of(draw) if with_twin else reference
    if twin not in references:
        try:
            references[twin] = _launch(twin, timeout_s)[0]
        except RankFailure as err:
            return Outcome(draw, "fail", f"perturbed reference raised: {err}", time.perf_counter() - start)
    expected = references[reference]
    if expected.refused or references[twin].refused:
        return Outcome(draw, "fail", f"reference refused: {expected.refused}", time.perf_counter() - start)
    problems = compare(draw, got, expected, references[twin])
    status = "fail" if problems else "pass"
    errors = errors_against(got, expected)
    errors.update({f"twin_{k}": v for k, v in errors_against([references[twin]], expected).items()})
    errors["floored"] = float(not problems and bool(compare(draw, got, expected, expected)))  # passed on the floor
    return Outcome(draw, status, "; ".join(problems), time.perf_counter() - start, errors)
