"""Turn what a user types after `--target` / `--draft` into what `mlxspec.load` takes.

A spec is, in this order:
    a local folder        an MLX model folder, or a pair folder from `mlxspec convert --draft`
    a recipe name         `models/<name>.json`: its offline pair when that was fetched, else
                          its Hugging Face repos where the hub can be used
    a Hugging Face repo   already-MLX repos are used as they are; others are converted once,
                          on first use, into a cache folder ($MLXSPEC_CACHE or
                          ~/.cache/mlxspec/models)
No `--target` means the recipe marked `"default": true`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import ModelNotFoundError

REPO_ROOT = Path(__file__).resolve().parent.parent
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Recipe:
    """A named target/draft pair: where to get it with and without the hub."""

    name: str
    path: Path  # the recipe file
    default: bool
    hub_target: str | None
    hub_draft: str | None
    offline: Path | None  # the offline pair (or single model) folder
    get: str | None  # the command that fetches the offline models

    @classmethod
    def read(cls, path: Path) -> "Recipe":
        data = json.loads(path.read_text())
        hub = data.get("hub") or {}
        off = data.get("offline") or {}
        folder = off.get("pair") or off.get("model") or off.get("path")
        root = path.resolve().parent.parent  # recipes live in <root>/models/
        return cls(
            name=data.get("name") or path.stem,
            path=path,
            default=bool(data.get("default")),
            hub_target=hub.get("target"),
            hub_draft=hub.get("draft"),
            offline=(root / folder) if folder else None,
            get=off.get("get"),
        )

    def offline_ready(self) -> bool:
        return self.offline is not None and (
            (self.offline / "mlxspec-pair.json").is_file() or (self.offline / "config.json").is_file()
        )


def recipe_dirs() -> list[Path]:
    dirs = [REPO_ROOT / "models", Path.cwd() / "models"]
    out: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def recipes() -> list[Recipe]:
    found: dict[str, Recipe] = {}
    for d in recipe_dirs():
        for path in sorted(d.glob("*.json")):
            try:
                r = Recipe.read(path)
            except (OSError, ValueError, AttributeError):
                continue  # a results file or anything else that is not a recipe
            if r.hub_target or r.offline:
                found.setdefault(r.name, r)
    return list(found.values())


def find_recipe(name: str) -> Recipe | None:
    for r in recipes():
        if r.name == name:
            return r
    return None


def default_recipe() -> Recipe:
    rs = recipes()
    for r in rs:
        if r.default:
            return r
    where = ", ".join(str(d) for d in recipe_dirs()) or str(REPO_ROOT / "models")
    raise ModelNotFoundError(
        f"no --target given and no default pair recipe (a models/*.json with \"default\": true) in {where}; "
        "pass --target <model folder or Hugging Face repo>"
    )


def hub_usable() -> bool:
    """Whether to reach for the Hugging Face hub: on a Mac by default, elsewhere when asked
    (MLXSPEC_USE_HUB=1). Never when the hub is switched off (HF_HUB_OFFLINE=1)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    flag = os.environ.get("MLXSPEC_USE_HUB")
    if flag is not None:
        return flag.lower() in ("1", "true", "yes")
    return sys.platform == "darwin"


def cache_dir() -> Path:
    env = os.environ.get("MLXSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlxspec" / "models"


# -- one spec -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    target: str  # a folder path or an MLX repo id, as `mlxspec.load` takes it
    draft: str | None
    label: str  # what to call it in messages and JSON output


def _recipe_pair(r: Recipe) -> Resolved:
    if r.offline_ready():
        return Resolved(str(r.offline), None, r.name)  # a pair folder names its own draft
    hub_cmd = f"mlxspec chat --target {r.hub_target}" + (f" --draft {r.hub_draft}" if r.hub_draft else "")
    if r.hub_target and hub_usable():
        return Resolved(r.hub_target, r.hub_draft, r.name)
    get = r.get or "python scripts/get_offline_models.py"
    msg = f"the {r.name} pair is not here yet ({r.offline}); get it with `{get}`"
    if r.hub_target:
        msg += f" (or, where the Hugging Face hub can be reached: `MLXSPEC_USE_HUB=1 {hub_cmd}`)"
    raise ModelNotFoundError(msg)


def _is_mlx_repo(repo: str, fetch_config: Callable[[str], dict]) -> bool:
    """An MLX repo loads as it is: mlx-community's, or a config with MLX quantization."""
    if repo.split("/")[0].lower() == "mlx-community":
        return True
    cfg = fetch_config(repo)
    return "quantization" in cfg  # MLX writes this key; transformers writes quantization_config


def _hub_config(repo: str) -> dict:
    from huggingface_hub import hf_hub_download

    try:
        return json.loads(Path(hf_hub_download(repo, "config.json")).read_text())
    except Exception as e:
        raise ModelNotFoundError(
            f"could not read {repo} from the Hugging Face hub ({type(e).__name__}); "
            "check the name and the connection, or give a local folder"
        ) from e


def _convert(repo: str, out: Path) -> Path:
    try:
        from .convert import convert
    except ImportError as e:  # pragma: no cover - convert ships with the package
        raise ModelNotFoundError(f"{repo} needs converting but `mlxspec convert` is unavailable ({e})") from e
    print(f"Converting {repo} to MLX once, into {out} ...", file=sys.stderr)
    return Path(convert(repo, out, progress=True))


def resolve_one(
    spec: str,
    role: str = "target",
    *,
    fetch_config: Callable[[str], dict] = _hub_config,
    convert: Callable[[str, Path], Path] = _convert,
) -> Resolved:
    """One --target or --draft value. For a recipe name as the target, `draft` is the recipe's."""
    if spec.startswith("synthetic:"):  # random weights of a named shape (synthetic.py): timing only
        from .synthetic import SyntheticSpec

        SyntheticSpec.parse(spec)  # an unknown shape fails here, with the known ones
        raise ModelNotFoundError(
            f"{spec} has random weights and no tokenizer: it is for timing, with `mlxspec bench -t {spec} "
            "-d synthetic:...` (or mlxspec.load in Python, with token-id prompts)")
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(
                f"{spec} is a file, not a model folder; convert it first with `mlxspec convert {spec} <out folder>`"
            )
        if not (path / "config.json").is_file() and not (path / "mlxspec-pair.json").is_file():
            raise ModelNotFoundError(f"{spec} has no config.json (and is not a pair folder): not an MLX model folder")
        return Resolved(str(path), None, path.name)
    recipe = find_recipe(spec)
    if recipe is not None:
        res = _recipe_pair(recipe)
        if role == "draft":  # a recipe given as --draft: its draft model
            if res.draft is not None:
                return Resolved(res.draft, None, f"{recipe.name} draft")
            from .loading import read_pair_manifest

            folders = read_pair_manifest(Path(res.target))
            if folders is None or folders[1] is None:
                raise ModelNotFoundError(f"recipe {recipe.name} has no draft model")
            return Resolved(str(folders[1]), None, f"{recipe.name} draft")
        return res
    if spec.startswith((".", "/", "~")) or not _REPO_ID.match(spec):
        names = ", ".join(r.name for r in recipes())
        hint = f" (pair recipes here: {names})" if names else ""
        raise ModelNotFoundError(f"no such {role} model folder, recipe or repo: {spec}{hint}")
    if not hub_usable():
        raise ModelNotFoundError(
            f"{spec} is not a local folder and the Hugging Face hub is not in use here; "
            f"give a local folder, or set MLXSPEC_USE_HUB=1 where the hub can be reached"
        )
    cached = cache_dir() / spec.replace("/", "--")
    if (cached / "config.json").is_file():
        return Resolved(str(cached), None, spec)
    if _is_mlx_repo(spec, fetch_config):
        return Resolved(spec, None, spec)
    return Resolved(str(convert(spec, cached)), None, spec)


def resolve_pair(target: str | None, draft: str | None, use_draft: bool = True) -> Resolved:
    """The --target/--draft pair as `mlxspec.load(target, draft)` arguments. A pair folder or a
    recipe brings its own draft unless --draft overrides it; use_draft=False drops it."""
    if target is None:
        res = _recipe_pair(default_recipe())
    else:
        res = resolve_one(target, "target")
    if not use_draft:
        from .loading import read_pair_manifest

        folders = read_pair_manifest(Path(res.target)) if Path(res.target).is_dir() else None
        target_only = str(folders[0]) if folders is not None else res.target  # don't load a draft
        return Resolved(target_only, None, res.label)
    d = resolve_one(draft, "draft").target if draft is not None else res.draft
    return Resolved(res.target, d, res.label)
