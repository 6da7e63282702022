"""Feature generation: run the frozen target over the configured data, write a store.

Used by ``scripts/generate_features.py`` (one process, or one per rank under ``torchrun``
or ``deepspeed``). The work is cut into shards of ``features.samples_per_shard``
consecutive samples of one split, named ``<split>-<index>.safetensors``; shard g goes to
rank g mod W, so ranks never write the same file and any world size resumes any other's
work. A shard is written under a temporary name and renamed; a line in
``progress/rank-<r>.jsonl`` then records its SHA-256. A relaunch verifies recorded
shards by checksum and skips them; anything else (missing, partial, corrupt) is
regenerated. Rank 0 writes ``manifest.json`` (``complete: true``) once every shard is done.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from msd_train.config import SPLITS as _SPLITS
from msd_train.data.dataset import file_digest, split_limit
from msd_train.draft.loss import lm_head_argmax
from msd_train.features.store import (
    DTYPES,
    FORMAT,
    MANIFEST,
    VERSION,
    FeatureStoreError,
    SampleFeatures,
    dtype_name,
    human_bytes,
    ids_dtype,
    needed_rows,
    parse_manifest,
    prefix_plan,
    sample_bytes,
    sha256_file,
    write_shard,
)
from msd_train.paths import user_path
from msd_train.runtime import Group, atomic_write_text, local_device, resolve_dtype
from msd_train.targets.identity import target_identity
from msd_train.targets.protocol import TargetProtocol

log = logging.getLogger("msd_train.features")

SPLITS = _SPLITS  # the data.* lists a store can hold (stage.splits names them too)


def split_sources(cfg, name: str) -> list[dict]:
    return [OmegaConf.to_container(s, resolve=True) for s in (cfg.data.get(name) or [])]


def data_fingerprint(cfg, names) -> dict:
    """The data a store was made from: per split its files' names and SHA-1, and limits."""
    splits = {}
    for name in names:
        sources = split_sources(cfg, name)
        if not sources:
            continue
        splits[name] = {
            "files": [{"name": Path(s["path"]).name, "path": str(s["path"]), "sha1": file_digest(s["path"]),
                       "format": s.get("format", "auto"), "image_root": str(s.get("image_root"))} for s in sources],
            "limit": split_limit(cfg.data, name),
        }
    return {"max_length": int(cfg.data.max_length), "splits": splits}


def manifest_differences(manifest: dict, identity: dict, data: dict) -> list[str]:
    """Human-readable differences between a store and what the config asks for."""
    diffs = []
    st = manifest["target"]
    if st.get("weights_sha256") and identity.get("weights_sha256"):
        if st["weights_sha256"] != identity["weights_sha256"]:
            diffs.append(f"target weights: the store was made from {st['name']}, whose embedding table and "
                         f"lm_head differ from those of {identity['name']}")
    elif st.get("name") != identity.get("name"):
        diffs.append(f"target.name_or_path: store {st.get('name')!r}, config {identity.get('name')!r}")
    for k in ("family", "hidden_size", "vocab_size", "tokenizer_size", "image_token_id", "chat_template_sha1"):
        if st.get(k) != identity.get(k):
            diffs.append(f"target {k}: store {st.get(k)!r}, config {identity.get(k)!r}")
    sa, ca = st.get("adapter"), identity.get("adapter")
    if (sa is None) != (ca is None) or (sa and ca and (sa.get("sha256") or sa["path"]) != (ca.get("sha256") or ca["path"])):
        diffs.append(f"target.adapter: store {sa and sa['path']!r}, config {ca and ca['path']!r}")
    sd = manifest["data"]
    if sd["max_length"] != data["max_length"]:
        diffs.append(f"data.max_length: store {sd['max_length']}, config {data['max_length']}")
    for name, want in data["splits"].items():
        have = sd["splits"].get(name)
        if have is None:
            diffs.append(f"data.{name}: not in the store (it holds {', '.join(sd['splits']) or 'nothing'})")
            continue
        hf = [(f["name"], f["sha1"], f["format"]) for f in have["files"]]
        wf = [(f["name"], f["sha1"], f["format"]) for f in want["files"]]
        if hf != wf:
            diffs.append(f"data.{name} files: store {[f['path'] + ' sha1 ' + f['sha1'][:10] for f in have['files']]}, "
                         f"config {[f['path'] + ' sha1 ' + f['sha1'][:10] for f in want['files']]}")
        if have["limit"] is not None and (want["limit"] is None or want["limit"] > have["limit"]):
            diffs.append(f"data.{name}: the store holds the first {have['limit']} samples, the config asks for "
                         f"{want['limit'] or 'all'} (data.{'max_heldout' if name.startswith('heldout') else 'max_train'})")
    return diffs


def resolve_store_dtype(setting: str, compute_dtype: torch.dtype) -> torch.dtype:
    """``auto``: the target's own 16-bit dtype (bf16 for real targets on GPU, lossless);
    fp16 when the target computes in fp32 (CPU, the tiny target): three more mantissa bits
    than bf16 at the same size, with an overflow check at write time."""
    if setting == "auto":
        return compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else torch.float16
    if setting not in DTYPES:
        raise ValueError(f"features.dtype={setting}: use auto, bf16, fp16 or fp32")
    return DTYPES[setting]


def load_target_skeleton(tc):
    """A target with config, processor and tokenizer but no weights (meta device):
    enough to tokenise and count tokens without loading a 7B model."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from msd_train.targets import wrap_target

    config = AutoConfig.from_pretrained(tc.name_or_path, trust_remote_code=tc.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, trust_remote_code=tc.trust_remote_code)
    processor = AutoProcessor.from_pretrained(tc.name_or_path, trust_remote_code=tc.trust_remote_code)
    return wrap_target(model, processor, tc.name_or_path, tc.chat_template)


# ----------------------------------------------------------------------------- plan
@dataclass
class ShardPlan:
    file: str
    split: str
    index: int
    rows: list[int] = field(default_factory=list)  # row numbers in the split's dataset
    keys: list[str] = field(default_factory=list)

    def keys_sha1(self) -> str:
        return hashlib.sha1("\n".join(self.keys).encode()).hexdigest()


def plan_shards(datasets: dict, samples_per_shard: int) -> list[ShardPlan]:
    """Consecutive runs of ``samples_per_shard`` samples of each split, in split order.

    A key seen in an earlier split (the same file used twice) is kept once; two different
    samples with one key (two data files with the same name) are refused.
    """
    from msd_train.data.collate import sample_key

    seen: dict[str, tuple[str, int]] = {}
    plans = []
    for split, ds in datasets.items():
        rows, keys = [], []
        for i, (src, idx) in enumerate(zip(ds["source"], ds["index"])):
            key = sample_key({"source": src, "index": idx})
            if key in seen:
                other, j = seen[key]
                if datasets[other][j]["input_ids"] != ds[i]["input_ids"]:
                    raise FeatureStoreError(
                        f"two different samples have the key {key} (data.{other} and data.{split}): sample keys "
                        f"are '<file name>#<index>', so two data files named {Path(src).name} collide; rename one")
                continue
            seen[key] = (split, i)
            rows.append(i)
            keys.append(key)
        for s in range(0, len(rows), samples_per_shard):
            k = s // samples_per_shard
            plans.append(ShardPlan(f"{split}-{k:05d}.safetensors", split, k, rows[s:s + samples_per_shard],
                                   keys[s:s + samples_per_shard]))
    return plans


def estimate(datasets: dict, plans: list[ShardPlan], target: TargetProtocol, dtype: torch.dtype, id_dtype: torch.dtype,
             layers: list[int] | None = None) -> dict:
    """Exact counts and the bytes the shards will take (headers aside), from the token ids;
    ``layers``: the stored layer inputs (each adds H per stored row)."""
    itemsize, H = torch.tensor([], dtype=dtype).element_size(), target.hidden_size
    extra = H * len(layers or [])  # per stored row, beyond the last layer's H
    ids_size = torch.tensor([], dtype=id_dtype).element_size()
    mrope = target.uses_mrope
    out = {"samples": 0, "tokens": 0, "visual_tokens": 0, "bytes": 0, "splits": {}}
    for p in plans:
        part = datasets[p.split].select(p.rows)
        ids, masks, nvis = part["input_ids"], part["loss_mask"], part["n_visual"]
        _, shares = prefix_plan(ids, target.image_token_id, masks)
        b = max(shares) * ((H + extra) * itemsize + 4)
        for seq, m, v, P in zip(ids, masks, nvis, shares):
            b += sample_bytes(len(seq), v, needed_rows(m) - P, H, itemsize, ids_size, mrope and v > 0)
            b += (needed_rows(m) - P) * (extra * itemsize + 4)  # the layer inputs, the int32 top-1 id
        s = out["splits"].setdefault(p.split, {"samples": 0, "tokens": 0, "visual_tokens": 0, "bytes": 0, "shards": 0})
        for d in (s, out):
            d["samples"] += len(ids)
            d["tokens"] += sum(map(len, ids))
            d["visual_tokens"] += sum(nvis)
            d["bytes"] += b
        s["shards"] += 1
    out["shards"] = len(plans)
    # bf16 rows (a visual token also stores its projector output) and the int32 top-1 id
    out["budget_bytes"] = (2 * H + 4) * (out["tokens"] - out["visual_tokens"]) + (4 * H + 4) * out["visual_tokens"]
    return out


# ----------------------------------------------------------------------------- run
def _build_splits(cfg, target: TargetProtocol, names, group: Group) -> dict:
    from msd_train.data.dataset import build_split

    d = cfg.data
    out = {}
    with group.cache_first(d.cache_dir, "data.cache_dir"):  # tokenised once per job or node, then read
        for name in names:
            split = build_split(split_sources(cfg, name), target, d.max_length, d.on_bad_sample, d.cache_dir,
                                d.num_proc, split_limit(d, name))
            if split.skipped and group.rank == 0:
                log.warning("data.%s: %d samples skipped (scripts/check_data.py lists them with reasons)",
                            name, len(split.skipped))
            if len(split):
                out[name] = split.dataset
    return out


def _read_records(out: Path) -> dict[str, dict]:
    records = {}
    for f in sorted((out / "progress").glob("rank-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a kill
                continue
            records[rec["file"]] = rec
    return records


def _shard_ok(path: Path, rec: dict | None, plan: ShardPlan) -> str | None:
    """None when the shard on disk is the finished one its record describes, else why not."""
    if not path.is_file():
        return None if rec is None else "recorded but missing"
    if rec is None:
        return "present but not recorded as finished (interrupted)"
    if rec.get("keys_sha1") != plan.keys_sha1():
        return "holds other samples than planned"
    if path.stat().st_size != rec["bytes"] or sha256_file(path) != rec["sha256"]:
        return "checksum mismatch (corrupt or partially written)"
    return "ok"


def _features_of(rows: list[dict], target: TargetProtocol, batch_size: int,
                 layers: list[int] | None = None) -> list[SampleFeatures]:
    """Frozen forwards over ``rows`` in length-sorted batches; results in ``rows`` order.
    With ``layers`` a token's row is the inputs of those layers, then the last output
    ((k+1)*H wide: what an msd3 head reads, and what its loss compares with)."""
    from msd_train.data.collate import collate, sample_key

    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    out: list[SampleFeatures | None] = [None] * len(rows)
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        batch = collate([rows[i] for i in idx], target, pixels=True)
        f = target.features(batch["input_ids"], batch["attention_mask"], batch["pixel"], layers=layers)
        hidden = f.hidden_states if layers is None else torch.cat([f.layer_states, f.hidden_states], -1)
        top = lm_head_argmax(target.lm_head, f.hidden_states).cpu()  # stored: a pruned loss reads it
        embeds, hidden = f.inputs_embeds.cpu(), hidden.cpu()
        vmask, pos = f.visual_mask.cpu(), f.position_ids.cpu()
        for b, i in enumerate(idx):
            n = len(rows[i]["input_ids"])
            nvis = int(vmask[b].sum())
            has_pos = pos.ndim == 3 and nvis > 0  # M-RoPE positions are only non-trivial with images
            out[i] = SampleFeatures(
                key=sample_key(rows[i]), input_ids=batch["input_ids"][b, :n], loss_mask=batch["loss_mask"][b, :n],
                hidden=hidden[b, :n], visual=embeds[b][vmask[b]],
                position_ids=pos[:, b, :n] if has_pos else None,
                rope_delta=int(f.rope_deltas[b]) if has_pos else 0, top=top[b, :n])
    return out


def generate(cfg, dist=None, target: TargetProtocol | None = None) -> dict | None:
    """Generate (or resume, or with ``dry_run`` only estimate) the store at ``features.path``.

    Returns the manifest on rank 0 (the estimate for a dry run), None on other ranks.
    """
    # torch.distributed (older callers) or None
    group = dist if isinstance(dist, Group) else Group(dist if dist is not None and dist.is_initialized() else None)
    fc = cfg.features
    out = user_path(fc.path)
    device = local_device(cfg.target.device)
    dtype = resolve_store_dtype(str(fc.dtype), resolve_dtype(cfg.target.dtype, device))
    dry = bool(cfg.get("dry_run", False))
    if target is None:
        target = _load_target(cfg, device, dry)
    id_dtype = ids_dtype(max(target.vocab_size, len(target.tokenizer)))
    names = _split_names(cfg)

    layers = [int(i) for i in fc.layers] if fc.get("layers") is not None else None
    datasets = _build_splits(cfg, target, names, group)
    plans = plan_shards(datasets, int(fc.samples_per_shard))
    if dry:
        return _dry_run(datasets, plans, target, dtype, id_dtype, out, layers) if group.rank == 0 else None

    header = {
        "format": FORMAT, "version": VERSION, "complete": False,
        "target": target_identity(target, cfg.target.adapter), "dtype": dtype_name(dtype),
        "ids_dtype": dtype_name(id_dtype), "samples_per_shard": int(fc.samples_per_shard),
        "data": data_fingerprint(cfg, names),
    }
    if layers is not None:  # rows are these layers' inputs, then the last output (an msd3 head's features)
        header["layers"] = layers
    _open_store(out, header, group)
    mine = plans[group.rank::group.world]
    done, todo = _finished_and_todo(out, mine, group.rank)
    progress = out / "progress" / f"rank-{group.rank}.jsonl"
    bar = _progress_bar(cfg, group, todo)
    t0, tokens = time.perf_counter(), 0
    for p in todo:
        rows = [datasets[p.split][i] for i in p.rows]
        feats = _features_of(rows, target, int(cfg.batch_size), layers)
        rec = write_shard(out / p.file, feats, dtype, id_dtype, target.image_token_id)
        rec.update(split=p.split, index=p.index, rank=group.rank, keys_sha1=p.keys_sha1())
        _append_record(progress, rec)
        done.append(rec)
        tokens += rec["n_tokens"]
        if bar is not None:
            bar.update(len(p.rows))
            bar.set_postfix(shards=f"{len(done)}/{len(mine)}",
                            tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
    if bar is not None:
        bar.close()

    gathered = group.gather_object(done)
    if group.rank != 0:
        group.barrier()
        return None
    manifest = _write_manifest(out, header, plans, datasets, gathered, group.world)
    group.barrier()
    return manifest


def _load_target(cfg, device: torch.device, dry: bool):
    """The configured target; for a dry run only its skeleton (no weights)."""
    from msd_train.targets import load_target

    tc = cfg.target
    if dry:
        return load_target_skeleton(tc)
    return load_target(tc.name_or_path, tc.dtype, device, tc.adapter, tc.chat_template, tc.trust_remote_code,
                       tc.attn_implementation)


def _split_names(cfg) -> list[str]:
    """The ``splits`` to generate that have data, in the config's order; unknown names refused."""
    unknown = [n for n in cfg.splits if n not in SPLITS]
    if unknown:
        raise ValueError(f"splits={list(cfg.splits)}: unknown {unknown}; choose from {list(SPLITS)}")
    return [n for n in cfg.splits if split_sources(cfg, n)]


def _dry_run(datasets: dict, plans: list[ShardPlan], target: TargetProtocol, dtype: torch.dtype, id_dtype: torch.dtype,
             out: Path, layers: list[int] | None = None) -> dict:
    est = estimate(datasets, plans, target, dtype, id_dtype, layers)
    est["dtype"] = dtype_name(dtype)
    _print_estimate(est, target, out)
    return est


def _open_store(out: Path, header: dict, group: Group) -> None:
    """Rank 0 creates the folder or checks what is there; every rank raises its verdict."""
    error = _prepare_dir(out, header) if group.rank == 0 else None
    error = group.broadcast_object(error)
    if error:
        raise FeatureStoreError(error)


def _finished_and_todo(out: Path, mine: list[ShardPlan], rank: int) -> tuple[list[dict], list[ShardPlan]]:
    """This rank's shards split into the records of verified finished ones and those to (re)generate."""
    records = _read_records(out)
    todo, done = [], []
    for p in mine:
        state = _shard_ok(out / p.file, records.get(p.file), p)
        if state == "ok":
            done.append(records[p.file])
        else:
            if state is not None:
                log.warning("%s: %s; regenerating it", out / p.file, state)
            todo.append(p)
    if done:
        log.info("rank %d: %d shards already finished and verified, %d to go", rank, len(done), len(todo))
    return done, todo


def _progress_bar(cfg, group: Group, todo: list[ShardPlan]):
    """A samples bar on rank 0 unless ``progress=false``; None elsewhere."""
    if group.rank != 0 or not cfg.get("progress", True):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=sum(len(p.rows) for p in todo), desc=f"features (rank 0 of {group.world})",
                unit="sample", dynamic_ncols=True, file=sys.stdout)


def _append_record(progress: Path, rec: dict) -> None:
    """Record a finished shard durably: a relaunch trusts only what this file lists."""
    with open(progress, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write_manifest(out: Path, header: dict, plans: list[ShardPlan], datasets: dict, gathered: list[list[dict]],
                    world: int) -> dict:
    """Rank 0, once every rank is done: the complete manifest from all ranks' shard records."""
    by_file = {r["file"]: r for part in gathered for r in part}
    missing = [p.file for p in plans if p.file not in by_file]
    if missing:
        raise FeatureStoreError(f"{out}: shards {missing} were not produced; re-run the same command")
    shards = [by_file[p.file] for p in plans]
    manifest = {**header, "complete": True, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "command": " ".join(sys.argv), "world_size": world,
                "splits": {n: {"samples": sum(s["n_samples"] for s in shards if s["split"] == n),
                               "shards": sum(1 for s in shards if s["split"] == n)} for n in datasets},
                "totals": {k: sum(s[k] for s in shards) for k in ("n_samples", "n_tokens", "n_visual", "bytes")},
                "shards": shards}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    t = manifest["totals"]
    log.info("feature store %s complete: %d samples, %d tokens (%d visual), %d shards, %s", out,
             t["n_samples"], t["n_tokens"], t["n_visual"], len(shards), human_bytes(t["bytes"]))
    return manifest


def _prepare_dir(out: Path, header: dict) -> str | None:
    """Create the folder or check that what is there was made with the same settings."""
    mpath = out / MANIFEST
    damaged = False
    try:
        old = parse_manifest(mpath) if mpath.is_file() else None
    except FeatureStoreError as e:  # a damaged manifest: finished shards are verified, the manifest rewritten
        log.warning("%s", e)
        mpath.unlink()
        old, damaged = None, True
    if old is not None:
        old_header = {k: old.get(k) for k in ("format", "version", "dtype", "ids_dtype", "samples_per_shard", "layers")}
        new_header = {k: header.get(k) for k in old_header}
        diffs = [f"{k}: store {old_header[k]!r}, now {new_header[k]!r}" for k in old_header
                 if old_header[k] != new_header[k]]
        if old.get("format") == FORMAT:
            diffs += manifest_differences(old, header["target"], header["data"])
            if set(old["data"]["splits"]) != set(header["data"]["splits"]):
                diffs.append(f"splits: store {sorted(old['data']['splits'])}, now {sorted(header['data']['splits'])}")
        if diffs:
            return (f"{out} already holds a feature store made with other settings:\n  " + "\n  ".join(diffs)
                    + "\nchoose another features.path, or delete the folder to start over")
    elif not damaged and out.exists() and any(p.name != "progress" for p in out.iterdir()):
        return f"{out} is not empty and holds no {MANIFEST}; choose a new or empty features.path"
    out.mkdir(parents=True, exist_ok=True)
    if not mpath.is_file():
        atomic_write_text(mpath, json.dumps(header, indent=1))
    (out / "progress").mkdir(exist_ok=True)
    for tmp in out.glob("*.tmp"):  # left by a kill mid-write
        tmp.unlink()
    return None


def _print_estimate(est: dict, target: TargetProtocol, out: Path) -> None:
    H = target.hidden_size
    print(f"dry run: nothing written to {out}")
    print(f"target {target.name}: hidden size {H}, store dtype {est['dtype']}")
    for name, s in est["splits"].items():
        print(f"  {name:<20} {s['samples']:>9} samples {s['tokens']:>12} tokens ({s['visual_tokens']} visual) "
              f"{s['shards']:>6} shards {human_bytes(s['bytes']):>10}")
    text = est["tokens"] - est["visual_tokens"]
    print(f"total: {est['samples']} samples, {est['tokens']} tokens, {est['shards']} shards, "
          f"estimated {human_bytes(est['bytes'])} on disk ({human_bytes(est['bytes'] / max(est['samples'], 1))} per "
          f"sample, {est['bytes'] / max(est['tokens'], 1):.0f} bytes per token; the budget of 2H + 4 bytes per text token "
          f"and 4H + 4 per visual token is {human_bytes(est['budget_bytes'])} for {text} text and "
          f"{est['visual_tokens']} visual tokens)")
