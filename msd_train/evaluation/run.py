"""`python eval.py ...` without Hydra: a plain config dict in, report files out.

Ranks launched by ``torchrun`` / ``deepspeed`` split the benchmark items; each writes its
records, rank 0 merges them into one report (totals over all ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import re
import sys
from pathlib import Path

import torch

from msd_train import outputs
from msd_train.decoding import DecodeConfig, SamplingParams, Workspace
from msd_train.evaluation.bench import bench_decoding, grouped_by, load_bench
from msd_train.evaluation.metrics import DEFINITIONS, summarize, summarize_by_category
from msd_train.evaluation.report import write_report
from msd_train.evaluation.runner import evaluate
from msd_train.formatting import with_article
from msd_train.paths import user_path
from msd_train.runtime import local_device, setup_group
from msd_train.targets import TargetProtocol
from msd_train.validate import ConfigError, check_eval, check_head

log = logging.getLogger(__name__)


def decode_config(d: dict) -> DecodeConfig:
    """``conf/decoding/*.yaml`` (a plain dict) -> DecodeConfig. Only the settings the YAML
    states are passed: the defaults live in ``conf/decoding/_common.yaml`` (and, for
    library users, in DecodeConfig's fields; a test keeps the two equal)."""
    fields = {f.name for f in dataclasses.fields(DecodeConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ConfigError(f"decoding: unknown setting(s) {unknown}; the settings are {sorted(fields)} "
                          "(conf/decoding/_common.yaml); fix the override or the decoding YAML")
    d = dict(d)
    if "sampling" in d:
        s = d["sampling"] or {}
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        if set(s) - known:
            raise ConfigError(f"decoding.sampling: unknown setting(s) {sorted(set(s) - known)}; "
                              f"the settings are {sorted(known)}")
        d["sampling"] = SamplingParams(**s)
    return DecodeConfig(**d)


def decoding_settings(c: DecodeConfig) -> dict:
    out = {"method": c.method}
    if c.method == "tree":
        out.update(depth=c.depth, top_k=c.top_k, total_tokens=c.total_tokens)
    elif c.method in ("chain", "block"):
        out.update(k=c.k)
    out.update(max_new_tokens=c.max_new_tokens, temperature=c.sampling.temperature, top_p=c.sampling.top_p,
               sampling_top_k=c.sampling.top_k, greedy=c.sampling.greedy)
    if c.method == "tree" and not c.sampling.greedy:
        out["rank_by"] = c.sampling.rank_by
    if c.stop_strings:
        out["stop_strings"] = list(c.stop_strings)
    if c.ensemble is not None:  # ensemble drafting
        out.update(ensemble=c.ensemble, variants=list(c.variants), tabed_window=c.tabed_window)
    return out


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    from msd_train.evaluation.cpu_setting import cpu_identity

    n = torch.get_num_threads()
    return f"cpu ({cpu_identity()}, {n} thread{'s' if n != 1 else ''})"


def described_cpu(device: str | None) -> str | None:
    """The CPU a report's ``device`` names (``describe_device``'s ``cpu (CPU, N threads)``), else None."""
    m = re.fullmatch(r"cpu \((.*), \d+ threads?\)", device or "")
    return m.group(1) if m else None


def default_out(draft: str | None, bench: str, method: str) -> Path:
    """Beside the head's export folder when it is a local folder (where the model card
    looks for a report), named after it so that the reports of ``final/`` and ``best/``
    do not overwrite each other; else under ./eval."""
    if draft and user_path(draft).is_dir():
        head = user_path(draft).resolve()
        return head.parent / f"eval-{head.name}-{bench}-{method}"
    return Path("eval") / f"{bench}-{method}"


def check_images(items) -> None:
    """Open every image of the benchmark now: a missing or corrupt one would otherwise stop
    the run mid-benchmark, after the models loaded and part of the work was done."""
    from PIL import Image

    for item in items:
        try:
            item.check_image_files()
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
        for img in item.images:
            if not isinstance(img, (str, Path)):
                continue
            try:
                with Image.open(img) as im:
                    im.load()
            except Exception as e:  # PIL raises several types for broken files
                raise ConfigError(f"{item.source}, sample {item.id}: image {img} cannot be decoded "
                                  f"({type(e).__name__}: {e}); re-download it or remove the sample") from e


class _Partial:
    """Records appended to a JSONL file as they are measured, so an interruption keeps them;
    each record's ``item`` becomes its index over the whole benchmark, not the shard."""

    def __init__(self, path: Path, rank: int, world: int):
        self.path, self.rank, self.world = path, rank, world
        self.records: list[dict] = []
        self.f = open(path, "w", encoding="utf-8")

    def __call__(self, rec: dict) -> None:
        rec["item"] = self.rank + self.world * rec["item"]  # the runner keeps this same dict
        self.records.append(rec)
        self.f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def run_eval(cfg: dict, command: str | None = None) -> dict | None:
    """Evaluate ``cfg["draft"]`` on ``cfg["bench"]``; returns the report on rank 0."""
    device = local_device(cfg["target"].get("device", "auto"))  # cuda:LOCAL_RANK under a launcher
    group = setup_group(device, timeout_minutes=(cfg.get("dist") or {}).get("timeout_minutes"))
    rank, world = group.rank, group.world
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))

    check_eval(cfg, (cfg.get("decoding") or {}).get("method", "tree"))
    config = bench_decoding(cfg["bench"], decode_config(cfg["decoding"]))  # a benchmark may fix its length
    out = user_path(cfg["out"]) if cfg.get("out") else default_out(cfg.get("draft"), cfg["bench"].get("name", "bench"),
                                                              config.method)
    # now, not after the decoding: a file, a run, or a folder eval.py did not make is refused
    overwrite = bool(cfg.get("overwrite", False))
    outputs.check_output(out, "eval.py", overwrite, [cfg.get("draft")], recognise=_eval_folder)
    items = _checked_items(cfg, config)  # before the target: a wrong path fails in seconds
    # The report is written beside out= and renamed into place (a Ctrl-C's partial report too);
    # rank 0 holds the folder's lock, the other ranks write their samples into the same staging folder.
    claim = (outputs.output_dir(out, "eval.py", overwrite, [cfg.get("draft")], keep_partial=True,
                                recognise=_eval_folder) if rank == 0
             else contextlib.nullcontext(outputs.staging_path(out)))
    with claim as tmp:
        group.barrier()  # rank 0 made the staging folder
        target, draft = _load_models(cfg, config, device)
        workspace = Workspace()  # caches and captured steps, kept across the benchmark's prompts
        report_of = functools.partial(_report, cfg, draft, config, device, target, world, command, workspace)

        shard = items[rank::world]
        progress = bool(cfg.get("progress", True)) and rank == 0
        records = _evaluate_shard(cfg, target, draft, shard, config, tmp, group, progress, report_of, workspace)
        if world > 1:
            group.barrier()  # every rank's samples file is complete
            if rank != 0:
                return None
            records = _merge_rank_records(tmp, world)

        report = report_of(records)
        if config.ensemble is not None and config.method != "ar":  # ensemble drafting: each variant alone too
            from msd_train.evaluation.ensemble import ensemble_report

            report["ensemble"] = ensemble_report(target, draft, items if world > 1 else shard, config,
                                                 warmup=int(cfg["warmup"]), progress=progress)
        paths = write_report(tmp, report, records)
    paths = outputs.relocate(paths, tmp, out)
    log.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    _log_wandb(cfg.get("wandb") or {}, report, paths)
    return report


#: what eval.py writes into its out= folder (a folder of only these is one it made)
_EVAL_FILES = ("report.json", "report.md", "report.png", "samples.jsonl")


def _eval_folder(folder: Path) -> bool:
    """An eval.py output folder from before output records existed."""
    names = [p.name for p in folder.iterdir()]
    return bool(names) and all(n in _EVAL_FILES or n.startswith(("samples.rank", ".write-test-")) for n in names)


def _checked_items(cfg: dict, config: DecodeConfig) -> list:
    """The head, the benchmark's items and their images checked, before any model loads."""
    if config.method != "ar":
        check_head(cfg.get("draft"))
    items = load_bench(cfg["bench"])
    if not items:
        raise ConfigError(f"bench={cfg['bench'].get('name', 'bench')}: no items (check bench paths and max_* limits)")
    if config.ensemble is not None and "C" in config.variants:
        missing = [it for it in items if it.images and not it.captions]
        if missing:
            it = missing[0]
            raise ConfigError(f"{it.source}, sample {it.id}: decoding.variants has C but this sample's images have no "
                             f"captions ({len(missing)} of {len(items)} samples lack them); give each image a caption "
                             "(a `caption` field, or bench sources' `captions: FILE.json`) or drop C from decoding.variants")
    check_images(items)
    return items


def _load_models(cfg: dict, config: DecodeConfig, device: torch.device):
    """The target, and the head unless the method is plain autoregressive decoding (then None)."""
    from msd_train.evaluation.cpu_setting import choose
    from msd_train.targets import load_target

    tc = cfg["target"]
    setting = choose(tc, device)
    target = load_target(tc["name_or_path"], setting.dtype, device, tc.get("adapter"),
                         tc.get("chat_template"), bool(tc.get("trust_remote_code", False)),
                         setting.attn_implementation, onednn_linears=setting.linear == "onednn")
    target.decoding_setting = setting
    log.info("target setting: %s", setting.why)
    draft = None
    if config.method != "ar":
        from msd_train.hub.load import load_head

        draft = load_head(str(cfg["draft"]), target)
        if setting.linear == "onednn":  # the head's own layers on oneDNN too (its fp32 drafting steps)
            from msd_train.targets.cpu_linear import pack_linears

            pack_linears(draft)
        if config.ensemble is not None and draft.feature_layers is not None:
            raise ConfigError(
                f"decoding.ensemble={config.ensemble}: ensembles build their input variants from the target's last "
                f"layer, and {cfg['draft']} is {with_article(draft.architecture)} head (it reads the inputs of target layers "
                f"{draft.feature_layers}); evaluate it without decoding.ensemble")
    return target, draft


def _evaluate_shard(cfg: dict, target: TargetProtocol, draft, shard: list, config: DecodeConfig, out: Path, group, progress: bool,
                    report_of, workspace: Workspace) -> list[dict]:
    """This rank's records, each appended to its samples file as it is measured; their
    ``item`` is the index over the whole benchmark, not the shard."""
    rank, world = group.rank, group.world
    torch.manual_seed(int(cfg.get("seed", 0)))
    partial = _Partial(out / (f"samples.rank{rank}.jsonl" if world > 1 else "samples.jsonl"), rank, world)
    try:
        records = evaluate(target, draft, shard, config, warmup=int(cfg["warmup"]),
                           seed=int(cfg.get("seed", 0)), progress=progress, on_record=partial, workspace=workspace)
    except BaseException as e:  # Ctrl-C, an error mid-benchmark: keep a report of what was measured
        partial.close()
        if world == 1 and partial.records:
            kept = report_of(partial.records)
            kept["interrupted"] = f"{type(e).__name__} after {len(partial.records)} turns; partial results"
            paths = write_report(out, kept, partial.records)
            log.warning("interrupted: the %d turns measured so far are in %s", len(partial.records), paths["json"])
        raise
    partial.close()
    return records


def _merge_rank_records(out: Path, world: int) -> list[dict]:
    """Rank 0: every rank's samples file read, in benchmark order, and removed."""
    records = []
    for r in range(world):
        part = out / f"samples.rank{r}.jsonl"
        records += [json.loads(line) for line in part.read_text().splitlines() if line.strip()]
        part.unlink()
    records.sort(key=lambda x: (x["item"], x["turn"]))
    return records


def _report(cfg: dict, draft, config: DecodeConfig, device, target: TargetProtocol, world: int, command: str | None,
            workspace: Workspace, records: list[dict]) -> dict:
    tc = cfg["target"]
    bench_name = cfg["bench"].get("name", "bench")
    greedy = config.sampling.greedy
    local = draft is not None and Path(str(cfg.get("draft"))).is_dir()
    return {
        "draft": str(cfg.get("draft")) if draft is not None else None,
        # the head folder, absolute: the model card matches reports to heads by it
        "draft_folder": str(Path(str(cfg.get("draft"))).resolve()) if local else None,
        "target": tc["name_or_path"],
        "adapter": tc.get("adapter"),
        "bench": bench_name,
        "group_by": grouped_by(cfg["bench"]),  # the record field per_category is keyed by
        "method": config.method,
        "decoding": decoding_settings(config),
        "device": describe_device(device),
        "dtype": str(target.dtype).replace("torch.", ""),
        # what target.dtype=auto (and attention, linear kernels) became on this machine, and why
        "target_setting": target.decoding_setting.as_dict() if hasattr(target, "decoding_setting") else None,
        "world_size": world,
        "warmup": int(cfg["warmup"]),
        "seed": int(cfg.get("seed", 0)),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command or " ".join(sys.argv),
        "definitions": DEFINITIONS,
        "accept_at_pos_is": "conditional",
        "speedup_is": "ratio of totals",
        "overall": summarize(records, greedy),
        "per_category": summarize_by_category(records, greedy),
        # CUDA graphs over the whole run, warm-up included (this rank's): capture time is not in any time_s
        "graphs": {"enabled": workspace.graphs.enabled, "captures": workspace.graphs.captures,
                   "graph_capture_s": workspace.graphs.capture_s, "eager_fallback_steps": sorted(workspace.graphs.eager)},
    }


def _log_wandb(wc: dict, report: dict, paths: dict) -> None:
    mode = wc.get("mode", "disabled")
    if mode == "disabled":
        return
    import wandb

    run = wandb.init(project=wc.get("project", "msd-train"), entity=wc.get("entity"), name=wc.get("name"),
                     mode=mode, job_type="eval", config={k: report[k] for k in ("draft", "target", "bench", "decoding")})
    flat = {f"eval/{k}": v for k, v in report["overall"].items() if isinstance(v, (int, float)) and v is not None}
    for cat, m in report["per_category"].items():
        flat.update({f"eval/{cat}/{k}": v for k, v in m.items() if isinstance(v, (int, float)) and v is not None})
    if "png" in paths:
        flat["eval/plot"] = wandb.Image(str(paths["png"]))
    run.log(flat)
    run.finish()
