"""Several tests' rank functions in one forked world: what each would have got from its own ``run_on_ranks``.

Starting a world costs more than most op-level cases (forking every rank of a ~1 GB test process, its gloo
connections, its exit: about 0.3-0.5 s of CPU for 8 ranks on 2 cores, mostly system time), so the parametrized
layouts of a test run in one world per world size, each call building its own 2D groups in turn:

    per_call = run_each_on_ranks(8, [(run_grid, (2, 2, "head_first")), (run_grid, (4, 1, "context_first"))])
    per_call[1]  # by rank: what run_on_ranks(8, run_grid, 4, 1, "context_first") returned

A module-scoped fixture runs the selected cases this way (:func:`selected_params`) and hands each test its own
result, so each case still passes or fails on its own assertions; a rank that raises fails the world, with the call
it was in named in its traceback.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from megatron_2d.testing.distributed import run_on_ranks

Call = tuple[Callable[..., Any], tuple]
"""``(fn, args)``: ``fn(rank, world_size, *args)`` on every rank, as :func:`run_on_ranks` calls it."""


def _each(rank: int, world_size: int, calls: Sequence[Call]) -> list[Any]:
    results = []
    for index, (fn, args) in enumerate(calls):
        try:
            results.append(fn(rank, world_size, *args))
        except BaseException as err:
            err.add_note(f"in call {index} of the shared world: {fn.__name__}{args!r}"[:500])
            raise
    return results


def inherited_module_files() -> None:
    """Fill :mod:`inspect`'s table of modules by file for every module imported so far, here, so that forked ranks
    inherit it. ``torch.library.register_fake`` (flash-attn 2.7 on, at import) asks ``inspect.getframeinfo`` for its
    caller, which maps every module in ``sys.modules`` to its file on a first call: with megatron-core imported,
    about 0.3 s of CPU in every rank that imports such a release, instead of once here."""
    inspect.getmodule(inspect.currentframe())


def run_each_on_ranks(world_size: int, calls: Sequence[Call], **kwargs: Any) -> list[list[Any]]:
    """Run every ``(fn, args)`` of ``calls`` in turn in one world of ``world_size`` forked ranks; by call, the list
    by rank that ``run_on_ranks(world_size, fn, *args)`` returns. ``kwargs`` go to :func:`run_on_ranks`."""
    inherited_module_files()
    per_rank = run_on_ranks(world_size, _each, list(calls), **kwargs)
    return [[per_rank[rank][index] for rank in range(world_size)] for index in range(len(calls))]


def run_by_world(cases: dict[Hashable, tuple[int, Call]], **kwargs: Any) -> dict[Hashable, list[Any]]:
    """``cases``: {key: (world size, (fn, args))}; each key's results by rank, one world per world size."""
    results: dict[Hashable, list[Any]] = {}
    for world_size in sorted({world for world, _ in cases.values()}):
        keys = [key for key, (world, _) in cases.items() if world == world_size]
        per_call = run_each_on_ranks(world_size, [cases[key][1] for key in keys], **kwargs)
        results.update(zip(keys, per_call))
    return results


def selected_params(request, test_name: str, argnames: str) -> list[Any]:
    """The values of ``argnames`` (a parametrize string, e.g. "world, hp, w, placement") of the session's selected
    items of ``test_name`` in the requesting module, in collection order: what a module-scoped fixture must run, so
    that ``-k`` or a single node id runs its own cases only."""
    names = [name.strip() for name in argnames.split(",")]
    values = []
    for item in request.session.items:
        # getattr: the session also holds doctest items, which have neither
        if getattr(item, "module", None) is request.module and getattr(item, "originalname", None) == test_name:
            params = item.callspec.params
            value = tuple(params[n] for n in names) if len(names) > 1 else params[names[0]]
            if value not in values:
                values.append(value)
    return values
