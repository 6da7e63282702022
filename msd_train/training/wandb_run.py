"""The launch's wandb run (``logging.wandb.mode``: online, offline or disabled), on rank 0.

wandb mirrors ``metrics.jsonl`` and is never a reason to stop: a call that fails turns it
off for the rest of the launch with one warning. The deepspeed launcher answers Ctrl-C by
terminating the trainer's whole process tree, wandb's service process included, and the
logger must not stand between that signal and the checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def start(cfg, run_dir: Path, stage: int):
    """The wandb run of this stage, or None with ``logging.wandb.mode=disabled``. Its id comes
    from the run's name and run_dir, so a relaunch continues the same run (``resume="allow"``)."""
    lc = cfg.logging
    if lc.wandb.mode == "disabled":
        return None
    import wandb
    from omegaconf import OmegaConf

    name = lc.wandb.name or f"{Path(cfg.run_dir).name}-stage{stage}"
    run = wandb.init(
        project=lc.wandb.project, entity=lc.wandb.entity, name=name, mode=lc.wandb.mode,
        dir=str(run_dir), config=OmegaConf.to_container(cfg, resolve=True),
        resume="allow", id=f"{name}-{run_dir.name}".replace("/", "-")[:64],
    )
    # wandb's client runs on asyncio, which logs every send to a service that has died.
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    return run


def call(run, doing: str, fn, kept: Path):
    """``fn(run)`` on the wandb run, if any; returns the run, or None once a call failed (one
    warning naming ``doing`` and ``kept``, where every step still is)."""
    if run is None:
        return None
    try:
        fn(run)
        return run
    except Exception as e:
        log.warning("wandb failed while %s (%s: %s); training goes on without it, every step is still in %s",
                    doing, type(e).__name__, e, kept)
        import wandb

        try:  # unregisters wandb's exit hook, which would fail the same way at exit
            wandb.teardown()
        except Exception:
            pass
        return None
