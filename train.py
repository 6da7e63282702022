"""Train an MSD draft head: ``deepspeed train.py stage=1``, then ``stage=2``.

Also runs as ``python train.py ...`` (one process) and
``torchrun --nproc_per_node N train.py ...``. Re-launching the same command resumes
from the newest complete checkpoint of that stage.
"""

from msd_train.config import CONF_DIR, strip_launcher_args

strip_launcher_args()  # before Hydra parses sys.argv: drop the launcher's --local_rank

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from msd_train.training import run

    run(cfg)


if __name__ == "__main__":
    main()
