#!/usr/bin/env python
"""Serve an exported head in vLLM and set its figures beside this project's decoder.

    python scripts/serve_check.py draft=heads/tiny-vllm original=runs/tiny/stage2/final k=5   # tiny target, bench=tiny
    python scripts/serve_check.py draft=heads/tiny-vllm modes=[ar,plugin]
    python scripts/serve_check.py experiment=smollm2_llava bench=jsonl k=2   # its recipe's vLLM export and head

Run with the vLLM environment's python (``scripts/vllm_env.sh``). Decodes every benchmark
turn with this project's plain and chain-k decoders (the prompts every engine is given),
then runs vLLM without speculation, with the head and this project's plugin, and with the
head on stock vLLM; prints and writes ``report.json``: vLLM's mean acceptance length,
per-position acceptance and tokens/s, whether its speculative outputs equal its plain
outputs and the project's. ``original=`` names the head as it was before export (what eval.py
measures): the project's chain figures are then that head's, and what its export does
not carry is listed. The generation length follows eval.py's rule: the benchmark's own
``max_new_tokens`` (bench=mmspec: 1024) over ``max_new_tokens``; the report states it.
Arguments: conf/serve_check.yaml; docs/serving.md.
"""

import json
import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from msd_train.config import CONF_DIR
from msd_train.paths import user_path
from msd_train.validate import ConfigError, check_serve, user_errors


@hydra.main(config_path=str(CONF_DIR), config_name="serve_check", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plain = OmegaConf.to_container(cfg, resolve=True)
    with user_errors(FileNotFoundError):
        check_serve(plain)  # draft= given; experiment=NAME: its head trained and exported first
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"vLLM is not importable here ({e}); build its environment with "
                              "`bash scripts/vllm_env.sh` and run this script with .venv-vllm/bin/python") from None
        from msd_train.hub.vllm import vllm_layout
        from msd_train.serving import check
        from msd_train.serving.target import vllm_target

        draft = user_path(plain["draft"])
        config = json.loads((draft / "config.json").read_text()) if (draft / "config.json").is_file() else {}
        block = config.get("msd") or {}
        layout = vllm_layout(block) if block else None
        if layout is None:
            raise ConfigError(f"draft={draft}: not a head exported with format=vllm (config.json has no \"msd\" "
                              f"block); export it: python scripts/export.py checkpoint=HEAD format=vllm out={draft}")
        bad = [m for m in plain["modes"] if m not in check.MODES]
        if bad:
            raise ConfigError(f"modes={plain['modes']}: {bad} are not runs; use any of {list(check.MODES)}")
        fixed = layout.speculative_tokens(block)
        if fixed is not None and int(plain["k"]) != fixed:
            raise ConfigError(f"k={plain['k']}: a {block['architecture']} export drafts its whole block in vLLM "
                              f"(block_size {block['block_size']}): give k={fixed}")
        if not layout.stock_mode and "stock" in plain["modes"]:
            logging.info("modes: stock left out: %s", layout.stock)
            plain["modes"] = [m for m in plain["modes"] if m != "stock"]
        out = user_path(plain["out"]) if plain.get("out") else draft.parent / f"serve-check-{draft.name}-{plain['bench']['name']}"
        from msd_train.evaluation.bench import generation_length

        for key, value in (("max_new_tokens", plain["max_new_tokens"]),
                           ("bench.max_new_tokens", plain["bench"].get("max_new_tokens"))):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{key}={value!r}: give a whole number of new tokens, at least 1")
        k = int(plain["k"])
        n_new = generation_length(plain["bench"], plain["max_new_tokens"])  # eval.py's rule
        original = plain.get("original")
        if original is not None and not user_path(original).exists() and "/" not in str(original):
            raise ConfigError(f"original={original}: no such folder (the head before export, a folder or a Hub id)")
        original = str(user_path(original)) if original is not None and user_path(original).exists() else original

        prompts = check.project_prompts(plain["target"], plain["bench"], str(draft), k, n_new, original)
        target = vllm_target(plain["target"]["name_or_path"], user_path(plain["cache"]))
        spec = {"target": str(target), "k": k, "max_new_tokens": n_new, "dtype": plain["dtype"],
                "max_model_len": int(plain["max_model_len"]), "turns": prompts["turns"],
                "max_images": max([len(t["images"]) for t in prompts["turns"]] + [1]),
                "method": layout.method}
        runs = {}
        for mode in plain["modes"]:
            logging.info("vLLM: %s", mode)
            runs[mode] = check.vllm_process({**spec, "draft": None if mode == "ar" else str(draft)}, mode, out)
        report = check.compare(prompts, runs)
        report["settings"] = {"draft": str(draft), "original": original, "target": plain["target"]["name_or_path"],
                              "vllm_target": str(target), "bench": plain["bench"]["name"], "k": k,
                              "max_new_tokens": n_new, "dtype": plain["dtype"]}
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    for line in check.summary_lines(report, k):
        print(line)
    print(f"wrote {out / 'report.json'}")


if __name__ == "__main__":
    main()
