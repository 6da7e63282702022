"""`key=value` arguments of the hub scripts over their `conf/<name>.yaml`.

The spelling is Hydra's (`out=DIR private=true datasets=[a,b]`), parsed with OmegaConf
alone: here `target=` takes a path or Hub id as well as a `conf/target/` name, which a
Hydra config group would refuse, and the scripts write no output folders.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from msd_train.config import CONF_DIR


def parse_args(name: str, argv: list[str] | None = None, doc: str | None = None) -> DictConfig:
    """`conf/<name>.yaml` merged with `key=value` arguments; unknown keys and missing
    required (`???`) values are errors that name the key."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(doc or "")
        print(f"arguments (conf/{name}.yaml):\n" + OmegaConf.to_yaml(OmegaConf.load(CONF_DIR / f"{name}.yaml")))
        sys.exit(0)
    bad = [a for a in argv if "=" not in a or a.startswith("-")]
    if bad:
        sys.exit(f"{name}: arguments are key=value, got {' '.join(bad)} (see --help)")
    base = OmegaConf.load(CONF_DIR / f"{name}.yaml")
    OmegaConf.set_struct(base, True)
    try:
        cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(argv))
    except ConfigKeyError as err:
        sys.exit(f"{name}: unknown argument {err.key!r}; known: {', '.join(base.keys())}")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        sys.exit(f"{name}: missing required argument(s): {', '.join(f'{k}=...' for k in missing)}")
    return cfg


def resolve_target(value: str | None) -> tuple[str | None, str | None]:
    """`target=`: a `conf/target/<name>.yaml` (its name_or_path and adapter), or else a
    target path / Hub id as given. Returns (name_or_path, adapter)."""
    if value is None:
        return None, None
    path = CONF_DIR / "target" / f"{value}.yaml"
    if path.is_file():
        target = OmegaConf.load(path)
        return str(target.name_or_path), target.get("adapter")
    return str(value), None
