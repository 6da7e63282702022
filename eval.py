"""Measure a draft head: ``python eval.py draft=PATH out=DIR [target=...] [bench=...] [decoding=tree|chain|ar]``.

Runs plain autoregressive decoding and the chosen speculative method on the same prompts
in one process and writes ``DIR/report.json`` (tau, per-position acceptance, tokens/s,
speedup, exactness), ``report.md``, ``report.png`` and ``samples.jsonl``. Examples::

    python eval.py                                    # tiny target, runs/tiny/stage2/final
    python eval.py draft=runs/tiny/stage2/final decoding=chain decoding.k=4
    python eval.py target=llava15_7b draft=lucylyn/MSD-LLaVA1.5-7B bench=jsonl \\
        bench.path=mmspec.jsonl bench.image_root=images/
    python eval.py ... decoding.sampling.temperature=0.7   # lossless sampling (no exactness check)
    python eval.py experiment=smollm2_llava bench=jsonl     # the head its recipe ends with, on its prompts
"""

import sys

from msd_train.config import CONF_DIR, strip_launcher_args

strip_launcher_args()  # torchrun / deepspeed launchers: items are split over ranks

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402


@hydra.main(config_path=str(CONF_DIR), config_name="eval", version_base=None)
def main(cfg: DictConfig) -> None:
    import logging

    from msd_train.validate import check_eval, user_errors

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    plain = OmegaConf.to_container(cfg, resolve=True)
    command = " ".join(["python eval.py", *sys.argv[1:]])
    # A user's mistake (a bad path, value or image) is one message and exit 1; MSD_DEBUG=1 shows the traceback.
    # Ctrl-C keeps what was measured (report.json marked "interrupted") and exits 130.
    with user_errors(FileNotFoundError):  # the settings first, before torch and the decoder load: in a second
        check_eval(plain, (plain.get("decoding") or {}).get("method", "tree"))
    from msd_train.evaluation import run_eval
    from msd_train.hub.folders import IncompleteHeadError

    with user_errors(FileNotFoundError, IncompleteHeadError):
        try:
            report = run_eval(plain, command=command)
        except KeyboardInterrupt:
            print("interrupted; the turns measured so far are in the output folder's report.json", file=sys.stderr)
            sys.exit(130)
    if report is not None:
        o = report["overall"]
        print(f"tau {o['tau']:.3f}  speedup {o['speedup']:.2f}x  tokens/s {o['tokens_per_s']:.1f} "
              f"(AR {o['ar_tokens_per_s']:.1f})  outputs_match_ar {o['outputs_match_ar']}"
              if o["tau"] is not None else f"AR only: {o['ar_tokens_per_s']:.1f} tokens/s")
        setting = report.get("target_setting")
        if setting:  # what target.dtype / attn_implementation / cpu_linear became here, and why
            print(f"target: {setting['dtype']}, {setting['attn_implementation']} attention, {setting['linear']} linears "
                  f"({setting['why']})")
        # the generation length, as scripts/serve_check.py states it (evaluation.bench.generation_length)
        print(f"bench={report['bench']}: up to {report['decoding']['max_new_tokens']} new tokens a turn")


if __name__ == "__main__":
    main()
