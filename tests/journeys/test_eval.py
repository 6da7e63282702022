"""eval.py end to end, the benchmark readers and the metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import random_image

from msd_train.evaluation import load_bench, load_hf, run_eval, summarize

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ["tau", "accept_at_pos", "tokens_per_s", "ar_tokens_per_s", "speedup", "outputs_match_ar", "n_samples",
          "new_tokens"]


@pytest.mark.slow
def test_eval_py_end_to_end(target_dir, head_dir, tmp_path):
    out = tmp_path / "eval"
    cmd = [sys.executable, str(ROOT / "eval.py"), f"draft={head_dir}", f"out={out}", f"target.name_or_path={target_dir}",
           "bench.max_per_category=1", "decoding.max_new_tokens=8", "decoding.depth=2", "decoding.top_k=3",
           "decoding.total_tokens=8", "warmup=1", "progress=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "tree" and report["bench"] == "tiny" and report["device"].startswith("cpu")
    assert report["decoding"] == {"method": "tree", "depth": 2, "top_k": 3, "total_tokens": 8, "max_new_tokens": 8,
                                  "temperature": 0.0, "top_p": 1.0, "sampling_top_k": 0, "greedy": True}
    assert report["accept_at_pos_is"] == "conditional" and "conditional" in report["definitions"]["accept_at_pos"]
    assert report["speedup_is"] == "ratio of totals"
    assert report["command"].startswith("python eval.py draft=")
    cats = report["per_category"]
    assert set(cats) == {"text", "image_question", "image_followup", "multi_image"}
    for m in [report["overall"], *cats.values()]:
        assert all(k in m for k in FIELDS)
        assert m["outputs_match_ar"] is True and m["tau"] >= 1 and m["speedup"] > 0
    assert report["overall"]["n_samples"] == 4
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == report["overall"]["n_turns"] >= 5  # the follow-up item has two turns
    assert all(s["time_s"] > 0 and s["ar_time_s"] > 0 and "verify_s" in s for s in samples)
    assert (out / "report.png").stat().st_size > 0 and "| **overall** |" in (out / "report.md").read_text()


@pytest.mark.slow
def test_eval_py_with_an_ensemble(target_dir, head_dir, tmp_path):
    """Tree drafting with TABED over M, T, P and C (captions from the
    tiny bench's captions file); the report has tau per variant and for the ensemble."""
    out = tmp_path / "eval"
    cmd = [sys.executable, str(ROOT / "eval.py"), f"draft={head_dir}", f"out={out}", f"target.name_or_path={target_dir}",
           "decoding.ensemble=tabed", "decoding.variants=[M,T,P,C]", "bench.max_per_category=1",
           "decoding.max_new_tokens=6", "decoding.depth=2", "decoding.top_k=3", "decoding.total_tokens=8",
           "warmup=0", "progress=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["decoding"]["ensemble"] == "tabed" and report["decoding"]["variants"] == ["M", "T", "P", "C"]
    ens = report["ensemble"]
    assert list(ens["tau"]) == ["M", "T", "P", "C", "tabed-MTPC"]
    assert set(ens["tau_per_category"]["C"]) == {"text", "image_question", "image_followup", "multi_image"}
    assert ens["outputs_identical"] is True and report["overall"]["outputs_match_ar"] is True
    assert ens["prefill_ms_per_turn"]["C"] > 0 and "draft_overhead_vs_M" in ens
    assert "| tabed-MTPC |" in (out / "report.md").read_text()


def test_captions_are_read_and_required_for_c(target_dir, head_dir, tmp_path):
    random_image(0, 24).save(tmp_path / "0.png")
    random_image(1, 24).save(tmp_path / "1.png")
    rows = [{"id": "own", "image": "0.png", "turns": ["what is it?"], "caption": "a red circle"},
            {"id": "none", "image": ["0.png", "1.png"], "turns": ["which has more?"]},
            {"id": "text", "image": None, "turns": ["hello"]}]
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_bench({"kind": "jsonl", "path": str(path)})
    assert [i.captions for i in items] == [["a red circle"], [], []]
    # a source's captions file, keyed by the image paths the records write
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps({"shapes/heldout_00017.png": "one shape", "shapes/heldout_00180.png": "two shapes"}))
    tiny = load_bench({"kind": "conversations", "sources": [
        {"path": str(ROOT / "data/tiny/llava_heldout.json"), "image_root": str(ROOT / "data/tiny/images"),
         "captions": str(caps)}]})
    assert next(i for i in tiny if i.id == "heldout000200").captions == ["one shape", "two shapes"]
    assert next(i for i in tiny if i.id == "heldout000001").captions == []  # not in the file
    # C without captions fails before the target loads, naming the sample and the fix
    cfg = {"target": {"name_or_path": target_dir, "device": "cpu"}, "draft": head_dir,
           "bench": {"name": "b", "kind": "jsonl", "path": str(path)}, "out": str(tmp_path / "out"),
           "decoding": {"method": "chain", "k": 2, "ensemble": "ibed", "variants": ["M", "C"]}}
    with pytest.raises(ValueError, match=r"bench.jsonl, sample none: .* no captions .*caption"):
        run_eval(cfg)


def _mmspec(tmp_path: Path) -> Path:
    (tmp_path / "img").mkdir()
    for i in range(3):
        random_image(i, 24).save(tmp_path / "img" / f"{i}.png")
    rows = [
        {"id": "a", "image": "0.png", "turns": ["what colour is the circle?", "and the square?"], "category": "chat"},
        {"id": "b", "image": ["1.png", "2.png"], "turns": ["which image has more shapes?"], "category": "multi"},
        {"id": "c", "image": None, "turns": ["hello world"], "category": "text"},
    ]
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_jsonl_bench_multi_turn(target_dir, head_dir, tmp_path, temperature):
    bench = {"name": "mmspec", "kind": "jsonl", "path": str(_mmspec(tmp_path)), "image_root": str(tmp_path / "img")}
    cfg = {"target": {"name_or_path": target_dir, "device": "cpu"}, "draft": head_dir, "bench": bench,
           "decoding": {"method": "chain", "k": 3, "max_new_tokens": 6, "sampling": {"temperature": temperature}},
           "out": str(tmp_path / "out"), "warmup": 0, "progress": False}
    report = run_eval(cfg)
    assert set(report["per_category"]) == {"chat", "multi", "text"}
    assert report["overall"]["n_samples"] == 3 and report["overall"]["n_turns"] == 4
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    first, second = [s for s in samples if s["id"] == "a"]
    # the second turn's prompt holds the first turn, its answer and the new question
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["new_tokens"]
    if temperature:
        assert report["overall"]["outputs_match_ar"] is None and report["decoding"]["greedy"] is False
    else:
        assert report["overall"]["outputs_match_ar"] is True


def test_bench_readers(tmp_path, monkeypatch):
    items = load_bench({"kind": "jsonl", "path": str(_mmspec(tmp_path)), "image_root": str(tmp_path / "img")})
    assert [len(i.images) for i in items] == [1, 2, 0]
    assert items[1].turns[0].startswith("<image>\n<image>\n")  # markers put before the first turn
    assert len(items[1].load_images()) == 2

    tiny = load_bench({"kind": "conversations", "max_per_category": 2, "max_turns": 1, "sources": [
        {"path": str(ROOT / "data/tiny/sharegpt_heldout.json")},
        {"path": str(ROOT / "data/tiny/llava_heldout.json"), "image_root": str(ROOT / "data/tiny/images")}]})
    assert len(tiny) == 8 and all(len(i.turns) == 1 for i in tiny)
    assert {i.category for i in tiny} == {"text", "image_question", "image_followup", "multi_image"}

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "image": "nope.png", "turns": ["hi"]}) + "\n")
    with pytest.raises(FileNotFoundError, match="bad.jsonl, sample x: image .*nope.png not found"):
        load_bench({"kind": "jsonl", "path": str(bad)})[0].load_images()

    class FakeDataset(list):
        def select(self, idx):
            return FakeDataset(self[i] for i in idx)

    rows = FakeDataset([{"qid": 7, "image": random_image(0), "question": "what is it?", "split": "gqa"},
                        {"qid": 8, "image": None, "question": ["one", "two"], "split": "chat"}])
    fake = type(sys)("datasets")
    fake.load_dataset = lambda name, subset, split, revision: rows
    monkeypatch.setitem(sys.modules, "datasets", fake)
    items = load_hf("org/bench", id_field="qid", category_field="split", max_samples=5)
    assert [(i.id, i.category, i.turns) for i in items] == [("7", "gqa", ["<image>\nwhat is it?"]),
                                                            ("8", "chat", ["one", "two"])]


def test_metrics_definitions():
    def rec(item, accepted, tried, new, t, ar_t):
        return {"item": item, "accepted": accepted, "tried": tried, "new_tokens": new, "ar_new_tokens": new,
                "time_s": t, "ar_time_s": ar_t, "prefill_s": 0.0, "ar_prefill_s": 0.0, "draft_s": 0.0,
                "verify_s": 0.0, "accept_s": 0.0, "outputs_match_ar": True}

    records = [rec(0, [2, 0, 1], [3, 1, 2], 8, 1.0, 2.0), rec(1, [3], [3], 10, 1.0, 8.0)]
    m = summarize(records, greedy=True)
    assert m["tau"] == (3 + 1 + 2 + 4) / 4
    # position 1 tried 4 times, accepted 3; position 2: tried 3 (cycles with >= 1 accepted and depth >= 2), accepted 2
    assert m["accept_at_pos"] == [3 / 4, 2 / 3, 1 / 2]
    assert m["speedup"] == pytest.approx((18 / 2.0) / (18 / 10.0))  # ratio of totals, not mean of ratios (2.5)
    assert m["n_samples"] == 2 and m["outputs_match_ar"] is True


def test_ar_only_and_default_out(target_dir, tmp_path, monkeypatch):
    """decoding=ar needs no head; without out= the report lands in ./eval/<bench>-<method>."""
    monkeypatch.chdir(tmp_path)
    bench = {"name": "mmspec", "kind": "jsonl", "path": str(_mmspec(tmp_path)), "image_root": str(tmp_path / "img")}
    cfg = {"target": {"name_or_path": target_dir, "device": "cpu"}, "draft": None, "bench": bench,
           "decoding": {"method": "ar", "max_new_tokens": 4}, "warmup": 0, "progress": False}
    report = run_eval(cfg)
    assert report["draft"] is None and report["overall"]["tau"] == 1.0
    assert report["overall"]["accept_at_pos"] == [] and report["overall"]["outputs_match_ar"] is True
    assert (tmp_path / "eval" / "mmspec-ar" / "report.json").is_file()


def test_conversation_bench_keeps_each_records_category_past_blank_lines(tmp_path):
    """The category comes from the record the conversation was read from, also when the
    JSONL file has blank lines (one reader gives both the same line numbers)."""
    def conv(sid, category):
        return json.dumps({"id": sid, "category": category, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})

    path = tmp_path / "convs.jsonl"
    path.write_text(conv("a", "greeting") + "\n\n" + conv("b", "farewell") + "\n")
    items = load_bench({"kind": "conversations", "sources": [{"path": str(path)}]})
    assert [(i.id, i.category) for i in items] == [("a", "greeting"), ("b", "farewell")]
    path.write_text(conv("a", "greeting") + "\n{broken\n")
    with pytest.raises(ValueError, match=r"convs.jsonl, line 2: not valid JSON .*fix or delete that line"):
        load_bench({"kind": "conversations", "sources": [{"path": str(path)}]})
