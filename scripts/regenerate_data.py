"""Answer training conversations with the target itself (what EAGLE-3 trains on).

    python scripts/regenerate_data.py out=DIR inputs='[{path: sharegpt.json}]' target=smollm2_llava
    python scripts/regenerate_data.py out=DIR inputs='[{path: sharegpt.json}]' experiment=llava15_7b   # its target
    torchrun --nproc_per_node 8 scripts/regenerate_data.py out=DIR ...
    python scripts/regenerate_data.py out=DIR ... limit=200 max_new_tokens=256 temperature=0.7
    .venv-vllm/bin/python scripts/regenerate_data.py engine=vllm out=DIR ...   # batched in vLLM
    python scripts/regenerate_data.py engine=hf batch_size=16 out=DIR ...      # batched generate()

Re-running the same command resumes: finished conversations are skipped, none is written
twice. The result, DIR/regenerated.jsonl, is a messages JSONL with each conversation's
original turns kept beside (``original``); train on it with
``data.text='[{path: DIR/regenerated.jsonl}]'``. See msd_train/data/regenerate.py.
"""

import os
import sys

from msd_train.config import CONF_DIR, strip_launcher_args

strip_launcher_args()

import hydra  # noqa: E402  (after strip_launcher_args: Hydra must not see launcher flags)
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path=str(CONF_DIR), config_name="regenerate", version_base=None)
def main(cfg: DictConfig) -> None:
    import logging

    from omegaconf import OmegaConf

    from msd_train import runtime
    from msd_train.data.engines import EngineError, HFEngine, Sampling
    from msd_train.data.regenerate import RegenerateError, regenerate
    from msd_train.outputs import FolderLock, check_output, regeneration_folder
    from msd_train.paths import user_path
    from msd_train.serving.regenerate import VLLMEngine, vllm_version
    from msd_train.targets import load_target
    from msd_train.validate import ConfigError, _number, check_experiment, check_target, user_errors

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    settings = OmegaConf.to_container(cfg, resolve=True)
    kept = (f"every conversation answered so far is in {settings.get('out')}/rank-*.jsonl; relaunch the same command "
            "to answer the rest")
    with user_errors(RegenerateError, EngineError, FileNotFoundError, kept=kept):
        if OmegaConf.is_missing(cfg, "out"):
            raise ConfigError("out is not set; give out=DIR, the folder for the regenerated conversations")
        check_experiment(settings)  # experiment=NAME: on its own target
        for key in ("max_new_tokens", "max_prompt_tokens"):
            _number(settings, key, int, lo=1)
        for key in ("limit", "max_turns"):
            _number(settings, key, int, lo=1, allow_none=True)
        _number(settings, "temperature", float, lo=0)
        _number(settings, "batch_size", int, lo=1, allow_none=True)
        if settings["engine"] not in ("hf", "vllm"):
            raise ConfigError(f"engine={settings['engine']!r}: give engine=hf (transformers) or engine=vllm")
        if settings["engine"] == "vllm":
            vllm_version()  # missing or another release: said before the target loads
        _number(cfg, "dist.timeout_minutes", float, lo=0, lo_open=True)
        if not settings.get("inputs"):
            raise ConfigError("inputs is empty; give inputs='[{path: FILE}]' (ShareGPT, LLaVA-Instruct or messages JSONL)")
        # the guard every writer takes: a file, the current folder, a run, a feature store, a folder of
        # the user's, or one holding the inputs is refused; a regeneration folder is resumed
        check_target(settings["target"])  # a missing, half-written or cut target: before it loads
        out = check_output(user_path(settings["out"]), "scripts/regenerate_data.py", None,
                           sources=[user_path(i["path"]) for i in settings["inputs"] if i.get("path")],
                           recognise=regeneration_folder)
        # one launch per folder (the other ranks of a refused launch are stopped by its launcher)
        lock = FolderLock(out, "out") if int(os.environ.get("RANK", 0)) == 0 else None
        if lock is not None:
            lock.acquire()
        group = None
        try:
            group = runtime.setup_group(runtime.local_device(cfg.target.device),
                                        timeout_minutes=cfg.dist.timeout_minutes)
            tc = cfg.target
            target = load_target(tc.name_or_path, tc.dtype, runtime.local_device(tc.device), tc.adapter,
                                 tc.chat_template, tc.trust_remote_code, tc.attn_implementation)
            sampling = Sampling(int(settings["max_new_tokens"]), float(settings["temperature"]),
                                float(settings["top_p"]), int(settings["top_k"]))
            if settings["engine"] == "vllm":
                engine = VLLMEngine(target, tc.name_or_path, sampling,
                                    int(settings["max_prompt_tokens"]) + int(settings["max_new_tokens"]),
                                    settings["batch_size"] or 256, cache=settings["vllm"]["cache"],
                                    dtype=settings["vllm"]["dtype"])
            else:
                engine = HFEngine(target, sampling, settings["batch_size"] or 1)
            manifest = regenerate(target, settings, group, engine=engine)
        finally:
            if group is not None:
                group.destroy(barrier=False)
            if lock is not None:
                lock.release()
    if manifest is not None:
        t = manifest["this_launch"]
        print(f"{manifest['conversations']} conversations in {settings['out']}/{manifest['file']}; this launch: "
              f"{t['conversations']} conversations, {t['new_tokens']} new tokens in {t['seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
