"""bench=mmspec: an MMSpec-shaped split folder is read, decoded turn by turn and reported by topic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import random_image

from msd_train.evaluation import load_bench, run_eval

TOPICS = ["general vqa", "text vqa", "image captioning", "chart understanding", "complex reasoning pro",
          "multi-turn conversation"]


def mmspec_split(root: Path, per_topic: int = 1) -> Path:
    """A split folder as MMSpec ships it: mmspec.jsonl + images/, one image per sample."""
    (root / "images").mkdir(parents=True)
    rows = []
    for t, topic in enumerate(TOPICS):
        for k in range(per_topic):
            i = len(rows) + 1
            random_image(i, 24).save(root / "images" / f"mmspec_{i:03d}.jpg")
            turns = (["Describe the image.", "What colour is the largest shape?", "Why?"]
                     if topic == "multi-turn conversation" else [f"Question {i} about the image?"])
            rows.append({"id": f"mmspec_{i:03d}", "image": f"mmspec_{i:03d}.jpg", "turns": turns,
                         "category": f"cat{(t * per_topic + k) % 4}", "topic": topic})
    (root / "mmspec.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def compose_bench(*overrides: str) -> dict:
    """conf/eval.yaml's bench group as eval.py resolves it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from msd_train.config import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("eval", overrides=["bench=mmspec", "draft=none", *overrides])
    plain = OmegaConf.to_container(cfg, resolve=True)
    del plain["draft"]  # the head is not what these tests look at
    return plain


@pytest.mark.slow
def test_mmspec_report_is_grouped_by_topic(tmp_path, target_dir, head_dir, one_thread):
    split = mmspec_split(tmp_path / "test")
    cfg = compose_bench(f"bench.path={split}", "bench.max_new_tokens=4", "decoding=chain", "decoding.k=2")
    assert cfg["bench"]["group_by"] == "topic"
    cfg.update(draft=head_dir, out=str(tmp_path / "out"), warmup=0, progress=False)
    cfg["target"].update(name_or_path=target_dir, device="cpu")
    report = run_eval(cfg)
    assert report["group_by"] == "topic" and sorted(report["per_category"]) == sorted(TOPICS)
    assert report["decoding"]["max_new_tokens"] == 4  # the bench's length, not decoding's 64
    multi = report["per_category"]["multi-turn conversation"]
    assert multi["n_samples"] == 1 and multi["n_turns"] == 3  # every turn decoded
    assert report["overall"]["n_turns"] == 8 and report["overall"]["outputs_match_ar"] is True
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| chart understanding |" in md and "per topic" in md


def test_mmspec_defaults_follow_the_harness(tmp_path):
    """1024 new tokens a turn and every turn, as MMSpec's harness; images/ of the split folder."""
    from msd_train.evaluation.bench import bench_decoding
    from msd_train.evaluation.run import decode_config

    split = mmspec_split(tmp_path / "test", per_topic=2)
    cfg = compose_bench(f"bench.path={split}")
    config = bench_decoding(cfg["bench"], decode_config(cfg["decoding"]))
    assert config.max_new_tokens == 1024 and cfg["bench"]["max_turns"] is None
    items = load_bench(cfg["bench"])
    assert len(items) == 12 and {i.category for i in items} == set(TOPICS)
    assert all(Path(i.images[0]).parent == split / "images" and Path(i.images[0]).is_file() for i in items)
    assert items[0].turns[0].startswith("<image>\n")  # the image before the first turn
    by_category = load_bench({**cfg["bench"], "group_by": "category"})  # the finer labels on request
    assert {i.category for i in by_category} == {"cat0", "cat1", "cat2", "cat3"}
    # the .jsonl file itself works too, with image_root named
    same = load_bench({**cfg["bench"], "path": str(split / "mmspec.jsonl"), "image_root": str(split / "images")})
    assert [i.images for i in same] == [i.images for i in items]
    from msd_train.validate import check_eval

    with pytest.raises(ValueError, match="bench.max_new_tokens=0 must be at least 1"):
        check_eval({**cfg, "bench": {**cfg["bench"], "max_new_tokens": 0}}, "ar")


def test_broken_benchmark_files_name_the_file_and_line(tmp_path):
    split = mmspec_split(tmp_path / "test")
    lines = (split / "mmspec.jsonl").read_text().splitlines()
    lines[3] = lines[3][:-5]  # a cut line, as an interrupted download leaves it
    (split / "mmspec.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"mmspec.jsonl, line 4: not valid JSON .*fix or delete that line"):
        load_bench({"kind": "jsonl", "path": str(split), "group_by": "topic"})
    (split / "mmspec.jsonl").write_bytes("\n".join(lines[:3]).encode() + b'\n{"id": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"mmspec.jsonl: not UTF-8 text \(byte 0xe9 at line 4.*re-encode"):
        load_bench({"kind": "jsonl", "path": str(split)})
    with pytest.raises(FileNotFoundError, match="a folder without mmspec.jsonl"):
        load_bench({"kind": "jsonl", "path": str(tmp_path)})


def test_conversation_bench_with_a_break_keeps_the_turns_before_it(tmp_path, caplog):
    """A conversations bench file is read with the training readers' salvage: the user
    turns before a break are the prompts, with a warning naming the sample; group_by applies."""
    rows = [{"id": "ok", "topic": "chat", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},
            {"id": "cut", "topic": "chat", "conversations": [
                {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
                {"from": "gpt", "value": "a2"}, {"from": "gpt", "value": "again"}, {"from": "human", "value": "q3"},
                {"from": "gpt", "value": "a3"}]}]
    path = tmp_path / "convs.json"
    path.write_text(json.dumps(rows))
    with caplog.at_level("WARNING"):
        items = load_bench({"kind": "conversations", "group_by": "topic", "sources": [{"path": str(path)}]})
    assert [(i.id, i.category, i.turns) for i in items] == [("ok", "chat", ["q1"]), ("cut", "chat", ["q1", "q2"])]
    assert "sample cut: turn 4 is from assistant but user was expected" in caplog.text
