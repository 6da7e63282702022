"""The offline feature store: generation, resume, corruption, ranks, and training from it."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders.runs import batch_of, compose, data_overrides, gen_cfg, split_rows, train_cfg

from msd_train.features.generate import generate
from msd_train.features.offline import OfflineFeatures
from msd_train.features.store import FeatureStore, FeatureStoreError, sha256_file
from msd_train.runtime import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def target(mini_target):
    return mini_target


@pytest.fixture(scope="module")
def store(mini_run, target, tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "feats"
    manifest = generate(gen_cfg(mini_run, path), target=target)
    return path, manifest


def all_keys(manifest_dir: Path) -> list[str]:
    return list(FeatureStore(manifest_dir).index)


def test_store_layout_and_budget(store, target):
    path, manifest = store
    assert manifest["complete"] and manifest["totals"]["n_samples"] == 80
    assert {s["split"] for s in manifest["shards"]} == {"text", "multimodal", "heldout_text", "heldout_multimodal"}
    assert manifest["target"]["hidden_size"] == target.hidden_size and manifest["dtype"] == "float32"
    for s in manifest["shards"]:
        assert sha256_file(path / s["file"]) == s["sha256"]
    # Fewer hidden rows than tokens: the final rows training never reads are left out and
    # the shared prefix is stored once per shard.
    assert sum(s["n_hidden_rows"] for s in manifest["shards"]) < manifest["totals"]["n_tokens"]


def online_and_offline(store, mini_run, target, n_mm: int, n_text: int):
    """The same batch's features from the frozen target and from the store, and its rows."""
    source = OfflineFeatures(train_cfg(mini_run, store[0]), target)
    rows = split_rows(mini_run, target, "multimodal")[:n_mm] + split_rows(mini_run, target, "text")[:n_text]
    batch = batch_of(target, rows)
    on = target.features(batch["input_ids"], batch["attention_mask"], batch["pixel"])
    return on, source({**batch, "pixel": {}}), rows


def test_offline_features_equal_online_features(store, mini_run, target):
    on, off, rows = online_and_offline(store, mini_run, target, 3, 2)
    assert torch.equal(off.visual_mask, on.visual_mask) and off.visual_mask.any()
    text = ~off.visual_mask
    assert torch.equal(off.inputs_embeds[text], on.inputs_embeds[text])  # the frozen table, exactly
    # projector outputs computed in another batch: equal up to the vision tower's batch numerics
    torch.testing.assert_close(off.inputs_embeds, on.inputs_embeds, rtol=0, atol=1e-5)
    assert torch.equal(off.position_ids, on.position_ids)
    for i, r in enumerate(rows):
        last = max(j for j, m in enumerate(r["loss_mask"]) if m)  # rows 0 .. last-1 are what training reads
        torch.testing.assert_close(off.hidden_states[i, :last], on.hidden_states[i, :last], rtol=0, atol=1e-5)


def test_the_store_holds_the_targets_top1_for_a_pruned_loss(store, mini_run, target):
    """Each stored row comes with the target's top-1 id there (what draft.train_vocab's rule
    reads instead of a full-vocabulary product every step); -1 where no row is stored."""
    from msd_train.draft.loss import lm_head_argmax

    on, off, rows = online_and_offline(store, mini_run, target, 2, 3)
    want = lm_head_argmax(target.lm_head, on.hidden_states)
    top2 = target.lm_head(on.hidden_states).topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-3  # a random model has near-ties another batch's numerics may flip
    for i, r in enumerate(rows):
        last = max(j for j, m in enumerate(r["loss_mask"]) if m)
        sure = clear[i, :last]
        assert sure.float().mean() > 0.8
        assert torch.equal(off.target_top[i, :last][sure], want[i, :last][sure])
        assert (off.target_top[i, len(r["input_ids"]):] == -1).all()


def test_offline_store_reads_happen_in_the_loader_workers(store, mini_run, target, monkeypatch):
    """Training from a store: the DataLoader's workers read and check the shards with the
    collation; the training thread only embeds and copies (no store read there)."""
    from msd_train.data.collate import StepBatches, step_loader
    from msd_train.data.curriculum import Curriculum

    path, _ = store
    source = OfflineFeatures(train_cfg(mini_run, path), target)
    text, mm = split_rows(mini_run, target, "text"), split_rows(mini_run, target, "multimodal")
    ds = StepBatches(text, mm, target, 2, 2, 0, 1, pixels=False, features=source)
    loader = step_loader(ds, Curriculum(len(text), len(mm), 4, 0, 0.5, 0.5, 0, "linear"), 0, 2, 2, False)
    reads = []
    original = FeatureStore.read
    monkeypatch.setattr(FeatureStore, "read", lambda self, key: (reads.append(key), original(self, key))[1])
    steps = list(loader)  # forked workers: their reads are not counted here
    batches = [b for s in steps for b in s["micro_batches"]]
    assert len(batches) == 4 and all("offline" in b for b in batches) and any(b["n_images"] for b in batches)
    feats = [source(b) for b in batches]
    assert reads == []
    for b, f in zip(batches, feats):  # the same features as reading in place
        ref = source({k: v for k, v in b.items() if k != "offline"})
        assert torch.equal(f.hidden_states, ref.hidden_states) and torch.equal(f.inputs_embeds, ref.inputs_embeds)
    assert len(reads) == sum(len(b["keys"]) for b in batches)


def test_manifest_mismatch_is_refused_with_the_difference(store, mini_run, target):
    path, _ = store
    with pytest.raises(FeatureStoreError, match=r"data.max_length: store 512, config 256"):
        OfflineFeatures(train_cfg(mini_run, path, "data.max_length=256"), target)
    from builders import tiny_llava_target

    with pytest.raises(FeatureStoreError, match=r"target weights"):
        OfflineFeatures(train_cfg(mini_run, path), tiny_llava_target(seed=5))


@pytest.mark.slow
def test_a_store_over_all_the_data_serves_a_run_on_its_first_conversations(store, mini_run, target, tmp_path):
    """data.max_train=N: the first N conversations per training split, read from a store made over all
    of them (a data-size sweep needs one store); a store made over fewer is refused for more."""
    from msd_train.data.dataset import split_limit

    path, _ = store
    assert split_limit(train_cfg(mini_run, path, "data.max_train=3").data, "text") == 3
    assert split_limit(train_cfg(mini_run, path).data, "text") is None
    OfflineFeatures(train_cfg(mini_run, path, "data.max_train=3"), target)  # accepted
    small = generate(gen_cfg(mini_run, tmp_path / "small", "data.max_train=2", "splits=[text]"), target=target)
    assert small["totals"]["n_samples"] == 2
    with pytest.raises(FeatureStoreError, match=r"first 2 samples, the config asks for all \(data.max_train\)"):
        OfflineFeatures(train_cfg(mini_run, tmp_path / "small", "stage='1'", "stage.splits=[text]"), target)


def test_stored_ids_must_equal_batch_ids(store, mini_run, target):
    path, _ = store
    source = OfflineFeatures(train_cfg(mini_run, path), target)
    batch = batch_of(target, split_rows(mini_run, target, "text")[:2])
    batch["input_ids"][1, 3] += 1
    with pytest.raises(FeatureStoreError, match=rf"sample {batch['keys'][1]}: the token ids stored"):
        source(batch)


def test_dry_run_counts_and_estimates_without_writing(mini_run, target, tmp_path, capsys):
    est = generate(gen_cfg(mini_run, tmp_path / "dry", "dry_run=true", "features.dtype=bf16"), target=target)
    out = capsys.readouterr().out
    assert "dry run" in out and "80 samples" in out and "estimated" in out
    assert not (tmp_path / "dry").exists()
    assert est["samples"] == 80 and est["bytes"] <= est["budget_bytes"]
    real = generate(gen_cfg(mini_run, tmp_path / "real", "features.dtype=bf16"), target=target)
    assert 0 <= real["totals"]["bytes"] - est["bytes"] < 2000 * len(real["shards"])  # headers aside


def test_interrupted_generation_resumes_without_loss_or_duplicates(store, mini_run, target, tmp_path, monkeypatch,
                                                                   caplog):
    import msd_train.features.generate as gen

    ref_path, ref = store
    path = tmp_path / "feats"
    real_write, calls = gen.write_shard, []

    def write_then_die(p, *a, **kw):
        if len(calls) == 4:
            Path(str(p) + ".tmp").write_bytes(b"partial")  # a kill in the middle of a write
            raise KeyboardInterrupt
        calls.append(p)
        return real_write(p, *a, **kw)

    monkeypatch.setattr(gen, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        generate(gen_cfg(mini_run, path), target=target)
    with pytest.raises(FeatureStoreError, match="has not finished"):
        FeatureStore(path)
    monkeypatch.setattr(gen, "write_shard", real_write)
    with caplog.at_level(logging.INFO, logger="msd_train.features"):
        manifest = generate(gen_cfg(mini_run, path), target=target)
    assert "4 shards already finished and verified" in caplog.text
    keys = all_keys(path)
    assert len(keys) == len(set(keys)) == manifest["totals"]["n_samples"] == 80
    assert sorted(keys) == sorted(all_keys(ref_path))
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in ref["shards"]]
    assert not list(path.glob("*.tmp"))


def test_corrupt_shard_is_reported_by_name_and_regenerated(store, mini_run, target, tmp_path, caplog):
    import shutil

    path = tmp_path / "feats"
    shutil.copytree(store[0], path)
    victim = next(s for s in store[1]["shards"] if s["split"] == "multimodal")
    f = path / victim["file"]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))

    with pytest.raises(FeatureStoreError, match=victim["file"] + ": SHA-256 differs"):
        FeatureStore(path, verify="full")
    quick = FeatureStore(path)  # sizes match; the per-sample checksum catches it on read
    with pytest.raises(FeatureStoreError, match=rf"{victim['file']}: (sample .* fails its checksum|shared prefix)"):
        for key, (s, _) in quick.index.items():
            if quick.shards[s]["file"] == victim["file"]:
                quick.read(key)
    with caplog.at_level(logging.WARNING, logger="msd_train.features"):
        manifest = generate(gen_cfg(mini_run, path), target=target)
    assert f"{victim['file']}: checksum mismatch" in caplog.text
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in store[1]["shards"]]


@pytest.mark.slow
def test_two_rank_generation_writes_disjoint_shards_covering_the_data(store, mini_run, tmp_path):
    path = tmp_path / "feats2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "scripts" / "generate_features.py"), *data_overrides(mini_run), f"features.path={path}",
           "features.samples_per_shard=8", "features.dtype=fp32", "progress=false"]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    manifest = json.loads((path / "manifest.json").read_text())
    by_rank = {0: set(), 1: set()}
    st = FeatureStore(path)
    for key, (s, _) in st.index.items():
        by_rank[st.shards[s]["rank"]].add(key)
    assert by_rank[0] and by_rank[1] and not by_rank[0] & by_rank[1]
    assert by_rank[0] | by_rank[1] == set(all_keys(store[0]))
    assert manifest["totals"]["n_samples"] == 80
    # the same shards as one process writes
    assert [(s["file"], s["n_samples"], s["n_tokens"]) for s in manifest["shards"]] == \
        [(s["file"], s["n_samples"], s["n_tokens"]) for s in store[1]["shards"]]


def test_mrope_positions_round_trip(qwen_target, tmp_path):
    """Qwen2-VL: stored M-RoPE positions and rope deltas come back as the online forward's."""
    from builders import random_image

    from msd_train.data.collate import collate

    root = tmp_path / "q"
    (root / "img").mkdir(parents=True)
    recs = []
    for i in range(3):
        random_image(i, 32).save(root / "img" / f"{i}.png")
        recs.append({"id": i, "image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nwhat colour is it"}, {"from": "gpt", "value": "red " * (i + 1)}]})
    (root / "m.json").write_text(json.dumps(recs))
    (root / "t.json").write_text(json.dumps([{"id": 9, "conversations": [
        {"from": "human", "value": "hello"}, {"from": "gpt", "value": "hello world"}]}]))
    over = [f"data.text.0.path={root / 't.json'}", f"data.multimodal.0.path={root / 'm.json'}",
            f"data.multimodal.0.image_root={root / 'img'}", "data.heldout_text=[]", "data.heldout_multimodal=[]",
            f"data.cache_dir={root / 'cache'}", "target.name_or_path=tiny-random-qwen2vl"]
    cfg = compose("generate_features", [*over, f"features.path={root / 'feats'}", "features.dtype=fp32",
                                        "progress=false"])
    generate(cfg, target=qwen_target)
    source = OfflineFeatures(compose("config", [*over, "stage='2'", "features=offline",
                                                f"features.path={root / 'feats'}"]), qwen_target)
    rows = split_rows_from(cfg, qwen_target, "multimodal") + split_rows_from(cfg, qwen_target, "text")
    batch = collate(rows, qwen_target, pixels=True)
    on = qwen_target.features(batch["input_ids"], batch["attention_mask"], batch["pixel"])
    off = source({**batch, "pixel": {}})
    real = batch["attention_mask"].bool()
    assert torch.equal(off.position_ids[:, real], on.position_ids[:, real])
    assert torch.equal(off.rope_deltas, on.rope_deltas)
    torch.testing.assert_close(off.inputs_embeds, on.inputs_embeds, rtol=0, atol=1e-5)


def split_rows_from(cfg, target, name):
    from msd_train.data.dataset import build_split
    from msd_train.features.generate import split_sources

    ds = build_split(split_sources(cfg, name), target, cfg.data.max_length, "skip", cfg.data.cache_dir).dataset
    return [ds[i] for i in range(len(ds))]


@pytest.mark.slow
def test_offline_training_gives_the_online_loss(store, mini_run, target, tmp_path):
    """Same samples, same steps, fp32 store: the stage-2 losses of both runs agree."""
    from msd_train.draft import MSDDraftConfig, MSDDraftModel

    torch.manual_seed(0)
    head = tmp_path / "stage1"
    MSDDraftModel(MSDDraftConfig.from_target_config(target.config, target.name)).save_pretrained(head)
    common = ["stage=2", *mini_run, f"stage.init_from={head}", "stage.curriculum.start=0.5", "train.max_steps=3",
              "eval.every=3", "checkpoint.every=100", "train.micro_batch_size=4"]
    runs = {"online": ["features=online"], "offline": ["features=offline", f"features.path={store[0]}"]}
    procs = {m: subprocess.Popen([sys.executable, str(ROOT / "train.py"), *common, *x, f"run_dir={tmp_path / m}"],
                                 cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for m, x in runs.items()}
    for m, p in procs.items():
        out = p.communicate(timeout=600)[0]
        assert p.returncode == 0, f"{m}:\n{out[-5000:]}"

    def metrics(m):
        lines = (tmp_path / m / "stage2" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines]

    on, off = metrics("online"), metrics("offline")
    assert [m["step"] for m in on] == [m["step"] for m in off]
    assert any(m.get("mm_share", 0) > 0 for m in on)
    for a, b in zip(on, off):
        for k in ("loss", "feat_loss", "tok_loss", "val/multimodal/loss", "val/text/loss"):
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (k, a["step"])


def test_prefix_plan_follows_the_majority_and_stops_at_images():
    from msd_train.features.store import prefix_plan

    IMG = 9
    ids = [[1, 7, 7, 7, 5, 6, 2],  # a custom system prompt, first in the shard
           [1, 4, 4, 4, 4, 5, 6, 2],
           [1, 4, 4, 4, 4, 3, 3, 2],
           [1, 4, 4, IMG, IMG, 3, 2]]  # the image block ends the shared part
    masks = [[0] * (len(x) - 2) + [1, 1] for x in ids]
    ref, shares = prefix_plan(ids, IMG, masks)
    assert ref in (1, 2)
    assert shares[0] == 1 and shares[3] == 3
    assert shares[ref] == 7 and shares[3 - ref] == 5  # the reference shares all its needed rows with itself
