"""The training loop over a DeepSpeed engine (see recipe.py)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path


def run(cfg) -> None:
    """Check the config, take the run_dir, set up, train and export one stage; a user's
    mistake exits with its message (``MSD_DEBUG=1``: with the traceback). A launch refused
    before training began removes the output folder Hydra made for it (and the folders it
    made for that), so it leaves nothing in a folder it refused."""
    from msd_train.config import remove_hydra_output

    begun = []  # set once the recipe is made: from then on the log is the run's
    try:
        _run(cfg, begun)
    except BaseException as e:
        if not begun and not (isinstance(e, SystemExit) and e.code in (0, None)):
            remove_hydra_output()
        raise


def _launch_overrides() -> list[str]:
    """This launch's command-line overrides (Hydra's), for the fixes a refusal names; none when
    not launched by Hydra (a test calling ``run``)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:
        return []


def _run(cfg, begun: list) -> None:
    from omegaconf import OmegaConf

    from msd_train.paths import user_path
    from msd_train.validate import ConfigError, check_train, user_errors

    for key in ("run_dir", "stage.init_from", "features.path"):  # read as paths past here, by Path(...)
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, str) and value.startswith("~"):
            OmegaConf.update(cfg, key, str(user_path(value)))
    with user_errors():  # first, before torch and the training stack are imported: a mistake in seconds
        try:
            plain = OmegaConf.to_container(cfg, resolve=True)
        except Exception as e:  # an interpolation that cannot resolve (a missing env variable)
            raise ConfigError(f"the config does not resolve: {e}") from e
        check_train(plain, _launch_overrides())
    from msd_train.data.formats import BadSampleError
    from msd_train.draft import NonFiniteWeightsError  # stage.init_from names a head with NaN weights
    from msd_train.features.store import FeatureStoreError
    from msd_train.runtime import JoinError, SharedPathError, peer_gone  # launches over several nodes
    from msd_train.training import checkpoint as ckpt
    from msd_train.training import resume, rundir
    from msd_train.training.build_locks import clear_stale_build_locks
    from msd_train.training.objective import objective_refusal, train_vocab_refusal
    from msd_train.training.recipe import TrainingError, TrainRecipe, check_init_from_config

    with user_errors():  # the head's kind of training, with its registry: before anything is read
        architecture = OmegaConf.select(cfg, "draft.architecture", default="msd")
        kind = OmegaConf.select(cfg, "train.objective", default="supervised")
        why = objective_refusal(architecture, kind) or \
            train_vocab_refusal(architecture, kind, OmegaConf.select(cfg, "draft.train_vocab", default=None))
        if why:
            raise ConfigError(why)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    log = logging.getLogger("msd_train")
    lock = None
    recipe = None
    gone = False  # another rank is gone: no goodbye barrier
    with user_errors(TrainingError, FeatureStoreError, BadSampleError, rundir.RunDirError,
                     ckpt.CheckpointWriteError, NonFiniteWeightsError, resume.ResumeRefused, SharedPathError, JoinError,
                     kept=f"stopped before training began; the checkpoints and exports in {Path(cfg.run_dir)} are "
                          f"as they were (launch the same command to resume)"):
        try:
            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
            if rank == 0:
                # Before anything heavy: one launch per run_dir (the others' ranks are stopped by the
                # launcher when this one exits).
                lock = rundir.RunDirLock(Path(cfg.run_dir).resolve())
                lock.acquire()
                if ckpt.resume_disabled(cfg):
                    moved = rundir.set_aside(rundir.stage_dir(cfg))
                    if moved is not None:
                        log.warning("resume=false: the previous outputs of stage %s were moved to %s",
                                    cfg.stage.id, moved)
            # Where this stage starts, read once before anything heavy: the newest checkpoint (what it
            # cannot continue is refused, naming it), else stage.init_from's head, else a fresh one.
            start = resume.resume_point(cfg, rank, world)
            if start.init_from is not None:  # the head this stage starts from, before the target loads
                check_init_from_config(cfg)
            rundir.exit_with_launcher()
            # DeepSpeed compiles its communication op when the engine starts, waiting silently on
            # a build lock that a killed launch may have left.
            clear_stale_build_locks()
            begun.append(True)
            recipe = TrainRecipe(cfg, start)
            recipe.setup()
            try:
                recipe.train()
            except RuntimeError as e:
                if not peer_gone(e):
                    raise
                gone = True
                saved = ckpt.complete_checkpoints(recipe.ckpt_root)
                said = re.sub(r"^\[[^\]]*\]\s*", "", str(e).splitlines()[0]).split(". ")[0][:160]  # gloo's, less its source line
                raise TrainingError(
                    f"another process of this job is gone during step {recipe.step + 1} ({said}): "
                    f"a rank or a whole node was killed, crashed or lost its network (its own log says which), and "
                    f"this one stopped too. Steps after the newest checkpoint "
                    f"({saved[-1] if saved else 'none yet'}) are lost; launch the same command again on every node "
                    f"to resume from it") from e
        finally:
            try:
                if recipe is not None and hasattr(recipe, "group"):
                    recipe.cleanup(barrier=not gone)
            finally:
                if lock is not None:
                    lock.release()
