"""Check a dataset before a long run: what is kept, what is skipped and why, how long.

    python scripts/check_data.py [the target and data overrides you give train.py] [show=N] [json=FILE]
    python scripts/check_data.py data=sharegpt_llava665k target=llava15_7b \\
        data.text.0.path=/data/ShareGPT_V3_unfiltered_cleaned_split.json \\
        data.multimodal.0.path=/data/llava_v1_5_mix665k.json data.multimodal.0.image_root=/data/images

Reads every split of the data config with the readers training uses
(``msd_train.data.formats`` and ``build_split``) and the target's tokenizer, chat
template and image processor; the target's weights are not loaded. Prints per split the
records read, the samples kept, the samples skipped grouped by reason (and the first
``show`` of them with file, sample and fix), the images not found, the length
distribution after truncation at ``data.max_length`` and the share truncated. Exits 1
when no split holds a usable sample, 2 when a data file cannot be read at all.
A Hydra entry point like train.py, over conf/check_data.yaml; see docs/features.md.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import hydra
from omegaconf import DictConfig

from msd_train.config import CONF_DIR

SPLITS = ("text", "multimodal", "heldout_text", "heldout_multimodal")
NO_LIMIT = 1 << 30  # tokenise at full length, then apply data.max_length here to see what it cuts


def reason_group(reason: str) -> str:
    """A reason without its sample-specific parts, for counting."""
    if "not found" in reason and reason.startswith("image"):
        return "image not found"
    reason = re.sub(r"\(length \d+\)", "", reason)
    return re.sub(r"\d+", "N", reason).strip()


def percentiles(values: list[int]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {}
    a = np.asarray(values)
    return {"min": int(a.min()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": int(a.max()), "mean": float(a.mean())}


def check_split(cfg, target, name: str) -> dict:
    """Tokenise one split at full length and account for every record."""
    import torch
    from omegaconf import OmegaConf

    from msd_train.data.dataset import build_split, split_limit, truncate

    d = cfg.data
    sources = [OmegaConf.to_container(s, resolve=True) for s in d[name]]
    limit = split_limit(d, name)
    report = {"files": [s["path"] for s in sources], "limit": limit}
    try:
        split = build_split(sources, target, NO_LIMIT, "skip", d.cache_dir, d.num_proc, limit)
    except (FileNotFoundError, ValueError) as e:
        report["error"] = str(e)
        return report
    # A conversation truncated at a break is kept (its exchanges before the break): counted apart.
    salvaged = [{"source": b.source, "id": b.id, "index": b.index, "reason": b.reason, "fix": b.fix,
                 "kept_exchanges": b.kept_exchanges} for b in split.skipped if b.action == "truncated"]
    skipped = [{"source": b.source, "id": b.id, "index": b.index, "reason": b.reason, "fix": b.fix}
               for b in split.skipped if b.action != "truncated"]
    lengths, n_trunc, n_visual, n_text_only = [], 0, 0, 0
    ds = split.dataset
    for r in (ds[i] for i in range(len(ds))):
        ids, _, refused = truncate(torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"]), target.image_token_id,
                                   int(d.max_length))
        if refused:
            skipped.append({"source": r["source"], "id": r["id"], "index": r["index"], "reason": refused[0],
                            "fix": refused[1]})
            continue
        lengths.append(len(ids))
        n_trunc += len(ids) < len(r["input_ids"])
        n_visual += r["n_visual"]
        n_text_only += not r["images"]
    groups = Counter(reason_group(s["reason"]) for s in skipped)
    report.update(
        records=len(lengths) + len(skipped), kept=len(lengths), skipped=len(skipped),
        skipped_by_reason=dict(groups.most_common()), skipped_samples=skipped, salvaged=len(salvaged),
        salvaged_samples=salvaged,
        images_not_found=groups.get("image not found", 0), truncated=n_trunc,
        truncated_share=n_trunc / max(len(lengths), 1), text_only=n_text_only,
        tokens=sum(lengths), visual_tokens=n_visual, length=percentiles(lengths), max_length=int(d.max_length))
    return report


def print_report(name: str, r: dict, show: int) -> None:
    print(f"data.{name}: {', '.join(r['files'])}" + (f" (first {r['limit']} usable, data.{'max_heldout' if name.startswith('heldout') else 'max_train'})" if r["limit"] else ""))
    if "error" in r:
        print(f"  cannot be read: {r['error']}")
        return
    share = r["kept"] / max(r["records"], 1)
    print(f"  records {r['records']}, kept {r['kept']} ({share:.1%}), skipped {r['skipped']}"
          + (f", text-only {r['text_only']}" if name.endswith("multimodal") else ""))
    for reason, n in r["skipped_by_reason"].items():
        print(f"    {n:>8}  {reason}")
    for s in r["skipped_samples"][:show]:
        print(f"      {s['source']}, sample {s['id']}: {s['reason']} ({s['fix']})")
    if r["skipped"] > show:
        print(f"      ... {r['skipped'] - show} more (show=N, or json=FILE for all)")
    if r.get("salvaged"):
        print(f"  kept up to a break inside the conversation (listed as truncated): {r['salvaged']}")
    print(f"  images not found: {r['images_not_found']}")
    if r["length"]:
        L = r["length"]
        print(f"  length in tokens (after truncation at data.max_length={r['max_length']}): min {L['min']} "
              f"p50 {L['p50']:.0f} p90 {L['p90']:.0f} p99 {L['p99']:.0f} max {L['max']} mean {L['mean']:.1f}")
        print(f"  truncated: {r['truncated']} ({r['truncated_share']:.1%}); tokens {r['tokens']} "
              f"({r['visual_tokens']} visual)")


def check(cfg: DictConfig) -> int:
    """Check every split ``cfg.splits`` names; print the report; the exit status."""
    import logging

    from msd_train.features.generate import load_target_skeleton

    unknown = [n for n in cfg.splits if n not in SPLITS]
    if unknown:
        print(f"splits: unknown split(s) {', '.join(map(repr, unknown))}; choose from {', '.join(SPLITS)}",
              file=sys.stderr)
        return 2
    logging.getLogger("datasets").setLevel(logging.WARNING)
    target = load_target_skeleton(cfg.target)
    print(f"target {cfg.target.name_or_path} (tokenizer, template and image processor; no weights)")
    reports = {}
    for name in cfg.splits:
        if not cfg.data.get(name):
            continue
        reports[name] = check_split(cfg, target, name)
        print_report(name, reports[name], int(cfg.show))
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(reports, indent=1))
        print(f"report written to {cfg.json}")
    if any("error" in r for r in reports.values()):
        print("error: a data file cannot be read (see above)")
        return 2
    # the training splits decide, unless only held-out splits were asked for
    names = [n for n in ("text", "multimodal") if n in reports] or list(reports)
    usable = sum(reports[n]["kept"] for n in names)
    if usable == 0:
        print(f"error: no usable samples remain in {', '.join(f'data.{n}' for n in names) or 'any split'}")
        return 1
    print(f"ok: {usable} usable samples in {', '.join(f'data.{n}' for n in names)}")
    return 0


@hydra.main(config_path=str(CONF_DIR), config_name="check_data", version_base=None)
def main(cfg: DictConfig) -> None:
    from omegaconf import OmegaConf

    from msd_train.validate import check_target, user_errors

    with user_errors(ValueError):  # a missing target or data path, a damaged file: one line, exit 1
        check_target(OmegaConf.to_container(cfg.target, resolve=True))
        rc = check(cfg)
    if rc:
        sys.exit(rc)


if __name__ == "__main__":
    main()
