"""The op's call path and the planner's take few parameters (issue 44): no function of the op's modules takes more
than 8 (the public ``attention_2d`` / ``latent_attention_2d`` keep their keyword API and build one
``AttentionOptions``), and the planner's ``estimate`` takes a ``Job``. Read from the source (ast): pure and fast."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import megatron_2d

PACKAGE = Path(megatron_2d.__file__).parent
CALL_PATH = (
    "attention.py",
    "latent_attention.py",
    "head_all_to_all.py",
    "ring_attention.py",
    "kept_forward.py",
    "call/",
    "transport/",
    "plan/step.py",
    "plan/planner.py",
)
PUBLIC_KEYWORD_API = {("attention.py", "attention_2d"), ("latent_attention.py", "latent_attention_2d")}
MAX_PARAMETERS = 8


def parameter_counts(root: Path = PACKAGE, paths=CALL_PATH) -> dict[tuple[str, str], int]:
    """(module path, function) -> its parameters (self, cls and ctx not counted) for every function of ``paths``."""
    out = {}
    for entry in paths:
        files = sorted((root / entry).glob("*.py")) if entry.endswith("/") else [root / entry]
        for path in files:
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    names = [
                        x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls", "ctx")
                    ]
                    out[(path.relative_to(root).as_posix(), node.name)] = len(names)
    return out


def test_no_function_of_the_call_path_takes_more_than_8_parameters():
    counts = parameter_counts()
    assert ("call/plan.py", "prepare") in counts and ("attention.py", "run_attention_2d") in counts
    over = {key: n for key, n in counts.items() if n > MAX_PARAMETERS and key not in PUBLIC_KEYWORD_API}
    assert not over, f"functions of the op's call path over {MAX_PARAMETERS} parameters: {over}"


def test_the_check_sees_a_long_parameter_list(tmp_path):
    (tmp_path / "attention.py").write_text("def f(a, b, c, d, e, f, g, h, i):\n    pass\n")
    assert parameter_counts(tmp_path, ("attention.py",)) == {("attention.py", "f"): 9}


def test_the_planner_estimate_takes_a_job():
    from megatron_2d.plan.job import Job
    from megatron_2d.plan.step import estimate

    first = next(iter(inspect.signature(estimate).parameters.values()))
    assert first.annotation in (Job, "Job"), first
