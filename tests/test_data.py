"""Readers and tokenisation: every kind of bad input gets a clear error or a listed skip."""

import json

import pytest
from builders import random_image

from msd_train.data.dataset import build_split, write_skipped
from msd_train.data.formats import BadSampleError, read_conversations


def _write(tmp_path, name, recs, jsonl=False):
    p = tmp_path / name
    if jsonl:
        p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in recs) + "\n")
    else:
        p.write_text(json.dumps(recs))
    return p


def ex(a="hello there", b="hello world", **kw):
    return {"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": b}], **kw}


@pytest.fixture
def images(tmp_path):
    random_image(1).save(tmp_path / "ok.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG not really")
    return tmp_path


CASES = {
    "unknown_role": ({"id": "u1", "conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "x"}]},
                     "unknown role 'alien'"),
    "empty": ({"id": "e1", "conversations": []}, "empty or missing conversation"),
    "non_alternating": ({"id": "n1", "conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                                                       {"from": "gpt", "value": "c"}]}, "turns must alternate"),
    "empty_turn": ({"id": "t1", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": ""},
                                                  {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"}]},
                   "is empty"),
    "missing_image": (ex("<image>\nwhat", id=7, image="nope.png"), "not found"),
    "corrupt_image": (ex("<image>\nwhat", id="c1", image="corrupt.png"), "cannot be decoded"),
    "marker_mismatch": (ex("<image> and <image>", id="m1", image="ok.png"), "2 <image> markers but 1 images"),
    "too_long": (ex("hello " * 200, id="l1"), "no assistant tokens left within max_length"),
    "image_cut": (ex("hello " * 30 + "<image>", id="i1", image="ok.png"), "image block ends after max_length"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_sample_error_names_file_sample_and_fix(case, images, llava_target):
    rec, reason = CASES[case]
    p = _write(images, "bad.json", [ex(id=0), rec])
    with pytest.raises(BadSampleError) as err:
        build_split([{"path": str(p), "image_root": str(images)}], llava_target, 120, "error")
    msg = str(err.value)
    assert str(p) in msg and reason in msg
    sid = str(rec.get("id"))
    assert f"sample {sid}" in msg
    assert "on_bad_sample=skip" in msg


def test_skip_counts_lists_and_keeps_the_rest(images, llava_target, tmp_path):
    recs = [ex(id=0)] + [c[0] for c in CASES.values()] + [ex("<image>\nq", "red", id="ok-img", image="ok.png")]
    p = _write(images, "mixed.json", recs)
    split = build_split([{"path": str(p), "image_root": str(images)}], llava_target, 120, "skip",
                        cache_dir=str(tmp_path / "cache"))
    assert sorted(split.dataset["id"]) == ["0", "ok-img"]
    assert len(split.skipped) == len(CASES)
    write_skipped(tmp_path / "skipped.jsonl", split.skipped)
    listed = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert {d["id"] for d in listed} == {str(c[0].get("id")) for c in CASES.values()}
    assert all(d["reason"] and d["fix"] and d["source"] == str(p) for d in listed)


def test_malformed_jsonl_line_is_one_bad_sample(tmp_path, llava_target):
    p = _write(tmp_path, "x.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": "a"}]},
                                      '{"id": "b", "messages": [oops',
                                      {"id": "c", "messages": [{"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": "b"}]}], jsonl=True)
    split = build_split([{"path": str(p)}], llava_target, 100, "skip")
    assert split.dataset["id"] == ["a", "c"]
    assert "line 2 is not valid JSON" in split.skipped[0].message()
    with pytest.raises(BadSampleError, match="line 2 is not valid JSON"):
        build_split([{"path": str(p)}], llava_target, 100, "error")


def test_broken_json_array_file_says_how_to_fix(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('[{"id": 1, "conversations": [}')
    with pytest.raises(ValueError, match="broken.json: not valid JSON .* line 1"):
        list(read_conversations(p))


def test_sharegpt_quirks_and_llava_ids(tmp_path):
    recs = [
        {"id": "s1", "conversations": [{"from": "gpt", "value": "Hi, how can I help?"},
                                       {"from": "human", "value": "q"}, {"from": "chatgpt", "value": "a"},
                                       {"from": "human", "value": "unanswered"}]},
        {"id": 12, "image": "coco/1.jpg", "conversations": [{"from": "human", "value": "Describe.\n<image>"},
                                                             {"from": "gpt", "value": "A cat."}]},
        {"id": "sys", "conversations": [{"from": "system", "value": "Be nice."}, {"from": "human", "value": "q"},
                                        {"from": "bing", "value": "a"}]},
    ]
    out = list(read_conversations(_write(tmp_path, "x.json", recs), image_root="/data/images"))
    assert [o["id"] for o in out] == ["s1", "12", "sys"]
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant"]  # leading gpt, trailing human dropped
    assert out[1]["images"] == ["/data/images/coco/1.jpg"]
    assert out[1]["messages"][0]["content"].endswith("<image>")
    assert out[2]["messages"][0] == {"role": "system", "content": "Be nice."}


def test_llava_entry_without_marker_gets_one(tmp_path):
    recs = [{"id": 1, "image": "a.png", "conversations": [{"from": "human", "value": "What is it?"},
                                                          {"from": "gpt", "value": "x"}]}]
    out = list(read_conversations(_write(tmp_path, "x.json", recs)))
    assert out[0]["messages"][0]["content"] == "<image>\nWhat is it?"


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found"):
        list(read_conversations(tmp_path / "nope.json"))


def test_tokenised_split_is_cached(tmp_path, llava_target):
    p = _write(tmp_path, "x.json", [ex(id=i) for i in range(5)])
    cache = tmp_path / "cache"
    a = build_split([{"path": str(p)}], llava_target, 100, cache_dir=str(cache))
    files = sorted(cache.glob("*.arrow"))
    assert files
    b = build_split([{"path": str(p)}], llava_target, 100, cache_dir=str(cache))
    assert sorted(cache.glob("*.arrow")) == files
    assert a.dataset["input_ids"] == b.dataset["input_ids"]
    # a changed file gets a new cache entry
    p.write_text(json.dumps([ex("other question", id=i) for i in range(5)]))
    c = build_split([{"path": str(p)}], llava_target, 100, cache_dir=str(cache))
    assert c.dataset["input_ids"] != a.dataset["input_ids"]
