"""The builder process: rebuilds a pair from its specs and compiles the captured steps it still lacks.

    builder = start_builder(build_request(pair, target, draft, missing(pair)), log_file)   # the app, on a fresh cache
    python -m engine.models.builder REQUEST.json                                         # what that runs

Compiling runs its own kernels and threads for minutes; in its own process it never competes with the serving
process's compute thread, which decodes eagerly meanwhile and loads the packages when the builder exits.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from engine.capture.aoti import Recipe, build, package_file, write_meta
from engine.capture.packages import recipe_key
from engine.core.runtime import cache_dir
from engine.models.loading import load_pair

REPOSITORY = Path(__file__).resolve().parents[2]  # the folder `python -m engine...` runs from


def build_request(pair, target: str, draft: str | None, recipes: dict[str, list[Recipe]], **load) -> dict:
    """What a builder process needs to rebuild the same models (specs and the load options that change their
    weights or names) and the recipes to compile."""
    return {"target": target, "draft": draft, "dtype": str(pair.dtype).removeprefix("torch."),
            "device": str(pair.device), **load, "recipes": {role: [asdict(r) for r in rs] for role, rs in recipes.items()}}


def start_builder(request: dict, log_file) -> subprocess.Popen:
    """`python -m engine.models.builder REQUEST` in its own process (module docstring); its output goes to `log_file`."""
    folder = cache_dir() / "captured"
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f".request-{os.getpid()}.json"
    file.write_text(json.dumps(request))
    return subprocess.Popen([sys.executable, "-m", "engine.models.builder", str(file)], stdout=log_file,
                            stderr=subprocess.STDOUT, cwd=str(REPOSITORY))


def main(argv: list[str] | None = None) -> int:
    """Build the packages a request file names (see build_request); prints one line per package."""
    request = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    pair = load_pair(request["target"], request["draft"], dtype=request["dtype"], device=request["device"],
                     packed="off", calibrate=False, draft_vocab=request.get("draft_vocab"),
                     draft_quant=request.get("draft_quant", "none"))
    for role, recipes in request["recipes"].items():
        model = pair.target if role == "target" else pair.draft
        name = pair.target_name if role == "target" else pair.draft_name
        for fields in recipes:
            recipe = Recipe(**fields)
            key = recipe_key(model, name, recipe)
            file = package_file(key)
            if file.is_file():
                continue
            seconds = build(model, recipe, file)
            write_meta(file, key, seconds)
            print(f"built the {role}'s {recipe.describe()} in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
