"""Megatron-LM's top-level entry scripts (pretrain_gpt.py, pretrain_hybrid.py, their builders, model_provider.py) at
core_v0.19.0.

The megatron-core wheel ships megatron.core and megatron.training but not these scripts; the project keeps an
unchanged copy beside the repository, in ``<repo>/../shared/megatron-lm/core_v0.19.0`` (CI clones the repository
with ``shared/`` next to it). ``MEGATRON_LM_DIR`` points elsewhere, e.g. at a Megatron-LM checkout of that tag.
Tests and the CPU demo copy the scripts to a temporary folder and, for the patched route, apply the project's patches
there (one per entry script); the copy in ``shared/`` is never modified.

    python -m megatron_2d_dev.megatron_lm DEST [--patched] [--script pretrain_hybrid.py]   # prints DEST/SCRIPT
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess

TAG = "core_v0.19.0"
SCRIPTS = ("pretrain_gpt.py", "gpt_builders.py", "pretrain_hybrid.py", "hybrid_builders.py", "model_provider.py")
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]  # dev/megatron_2d_dev/ -> the checkout
PATCHES = tuple(
    REPO_ROOT / "patches" / f"megatron-lm-{TAG}-{entry}-2d.patch" for entry in ("pretrain_gpt", "pretrain_hybrid")
)


def megatron_lm_dir() -> pathlib.Path:
    """The folder holding the stock scripts; FileNotFoundError saying where it was looked for if absent."""
    configured = os.environ.get("MEGATRON_LM_DIR")
    folder = pathlib.Path(configured) if configured else REPO_ROOT.parent / "shared" / "megatron-lm" / TAG
    missing = [name for name in SCRIPTS if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Megatron-LM's {TAG} entry scripts are missing from {folder} ({', '.join(missing)}); they are expected "
            f"in <repo>/../shared/megatron-lm/{TAG} (a copy of NVIDIA/Megatron-LM's top-level files at tag {TAG}), "
            f"or set MEGATRON_LM_DIR to a folder that has them"
        )
    return folder


def copy_scripts(dest: os.PathLike, patched: bool = False, script: str = "pretrain_gpt.py") -> pathlib.Path:
    """Copy the stock scripts into ``dest`` (created if needed), apply the 2d patches if ``patched``; return the path
    of the copied ``script``."""
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    source = megatron_lm_dir()
    for name in SCRIPTS:
        shutil.copyfile(source / name, dest / name)
    # outside any repository (the ceiling stops git from finding one above dest), git apply acts as patch -p1
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(dest.resolve().parent))
    for patch in PATCHES if patched else ():
        result = subprocess.run(["git", "apply", str(patch)], cwd=dest, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{patch.name} does not apply to the scripts in {source}: {result.stderr.strip()}")
    return dest / script


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dest", help="folder to copy the scripts into")
    parser.add_argument("--patched", action="store_true", help="apply the project's 2d patches to the copy")
    parser.add_argument(
        "--script",
        default="pretrain_gpt.py",
        choices=("pretrain_gpt.py", "pretrain_hybrid.py"),
        help="the entry script whose path is printed",
    )
    args = parser.parse_args(argv)
    print(copy_scripts(args.dest, patched=args.patched, script=args.script))


if __name__ == "__main__":
    main()
