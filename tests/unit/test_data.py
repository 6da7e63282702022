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
    files = sorted(cache.glob("split-*/*.arrow"))
    assert files
    b = build_split([{"path": str(p)}], llava_target, 100, cache_dir=str(cache))
    assert sorted(cache.glob("split-*/*.arrow")) == files
    assert a.dataset["input_ids"] == b.dataset["input_ids"]
    # a changed file gets a new cache entry
    p.write_text(json.dumps([ex("other question", id=i) for i in range(5)]))
    c = build_split([{"path": str(p)}], llava_target, 100, cache_dir=str(cache))
    assert c.dataset["input_ids"] != a.dataset["input_ids"]


def _turns(*pairs):
    return [{"from": f, "value": v} for f, v in pairs]


def test_salvage_keeps_exactly_the_exchanges_before_the_break(tmp_path, llava_target):
    """Real ShareGPT dumps break deep inside a conversation (a repeated turn, an empty user
    turn): the whole exchanges before the break are kept, and the sample is listed in
    skipped_samples.jsonl as truncated with the reason."""
    random_image(1).save(tmp_path / "a.png")
    random_image(2).save(tmp_path / "b.png")
    good = [("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"), ("human", "q3"), ("gpt", "a3")]
    recs = [
        {"id": "repeat", "conversations": _turns(*good, ("human", "q4"), ("human", "q4 again"), ("gpt", "a4"),
                                                 ("human", "q5"), ("gpt", "a5"))},
        {"id": "empty-user", "conversations": _turns(*good[:2], ("human", " "), ("gpt", "a2"), *good[4:])},
        {"id": "tail", "conversations": _turns(*good[:2], ("human", "unanswered"))},  # a trim, not a truncation
        {"id": "first", "conversations": _turns(("human", "q"), ("human", "q"), ("gpt", "a"))},  # nothing before
        {"id": "two-images", "image": ["a.png", "b.png"],
         "conversations": _turns(("human", "<image>\nwhat is it?"), ("gpt", "a circle"),
                                 ("human", "<image>\nand this?"), ("gpt", "a square"), ("gpt", "twice"))},
    ]
    p = _write(tmp_path, "sharegpt.json", recs)
    got = list(read_conversations(p, "auto", tmp_path))
    convs = {r["id"]: r for r in got if isinstance(r, dict)}
    notes = {r.id: r for r in got if not isinstance(r, dict)}

    def text(sid):
        return [(m["role"], m["content"]) for m in convs[sid]["messages"]]

    as_chat = [("user" if f == "human" else "assistant", v) for f, v in good]
    assert text("repeat") == as_chat
    assert text("empty-user") == as_chat[:2]
    assert text("tail") == as_chat[:2] and "tail" not in notes
    assert "first" not in convs and notes["first"].action == "skipped"
    assert notes["repeat"].action == "truncated" and notes["repeat"].kept_exchanges == 3
    assert "turn 7 is from user but assistant was expected" in notes["repeat"].reason
    assert notes["empty-user"].kept_exchanges == 1 and "turn 2 (user) is empty" in notes["empty-user"].reason
    # the second image's marker is in the kept part: both images stay; the repeated answer goes
    assert text("two-images")[-1] == ("assistant", "a square")
    assert convs["two-images"]["images"] == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]

    split = build_split([{"path": str(p), "image_root": str(tmp_path)}], llava_target, 512, "skip")
    assert sorted(split.dataset["id"]) == ["empty-user", "repeat", "tail", "two-images"]
    write_skipped(tmp_path / "skipped_samples.jsonl", split.skipped)
    listed = {d["id"]: d for d in map(json.loads, (tmp_path / "skipped_samples.jsonl").read_text().splitlines())}
    assert {k: (d["action"], d["kept_exchanges"]) for k, d in listed.items()} == {
        "repeat": ("truncated", 3), "empty-user": ("truncated", 1), "first": ("skipped", None),
        "two-images": ("truncated", 2)}
    assert "turns must alternate" in listed["repeat"]["reason"] and listed["repeat"]["fix"]
    with pytest.raises(BadSampleError, match=r"sample repeat: turn 7 .* data.on_bad_sample=skip to train on the 3 exchanges"):
        build_split([{"path": str(p), "image_root": str(tmp_path)}], llava_target, 512, "error")


def test_a_cut_conversation_keeps_only_the_images_of_its_kept_turns(tmp_path):
    random_image(1).save(tmp_path / "a.png")
    rec = {"id": "x", "image": ["a.png", "b.png"],
           "conversations": _turns(("human", "<image>\nq1"), ("gpt", "a1"), ("human", "<image>\nq2"),
                                   ("human", "again"), ("gpt", "a2"))}
    got = list(read_conversations(_write(tmp_path, "x.json", [rec]), "auto", tmp_path))
    assert got[0].action == "truncated" and "1 of its 2 images" in got[0].reason
    assert got[1]["images"] == [str(tmp_path / "a.png")] and len(got[1]["messages"]) == 2


def test_non_utf8_file_names_the_file_line_and_fix(tmp_path):
    p = tmp_path / "latin1.jsonl"
    lines = [json.dumps({"id": i, "conversations": _turns(("human", "q"), ("gpt", "caf\u00e9"))}, ensure_ascii=False)
             for i in range(3)]
    p.write_bytes("\n".join(lines).encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl: not UTF-8 text \(byte 0xe9 at line 1, .*re-encode .*iconv"):
        list(read_conversations(p))
    p.write_bytes(("\n".join(lines)).encode("utf-8-sig"))  # a byte-order mark is fine
    assert [r["id"] for r in read_conversations(p)] == ["0", "1", "2"]
