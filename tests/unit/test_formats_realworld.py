"""The readers on excerpts that reproduce the quirks of the files users train on.

``data/examples/sharegpt_excerpt.json`` mimics ``ShareGPT_V3_unfiltered_cleaned_split.json``
and ``data/examples/llava_excerpt.json`` (with images under ``data/examples/images``)
mimics ``llava_v1_5_mix665k.json``; both are hand-written, see data/examples/README.md.
Each sample is read as a user's full file would be: which are kept, which skipped and why.
"""

from pathlib import Path

import pytest

from msd_train.data.dataset import build_split
from msd_train.data.formats import BadSample, BadSampleError, read_conversations
from msd_train.targets.chat import IMAGE_MARKER

EXAMPLES = Path(__file__).resolve().parents[2] / "data" / "examples"
SHAREGPT = EXAMPLES / "sharegpt_excerpt.json"
LLAVA = EXAMPLES / "llava_excerpt.json"
IMAGES = EXAMPLES / "images"

# id -> None (kept), a piece of the reason it is skipped for, or TRUNCATED(reason, exchanges kept)
SHAREGPT_EXPECTED = {
    "QWJhYvA_0": None,  # markdown: code fences, lists, a table
    "QWJhYvA_1": None,  # a split continuation opening with gpt: the greeting is trimmed
    "nR7fK2p_0": None,  # a leading system prompt is kept
    "nR7fK2p_1": None,  # an empty system prompt is dropped
    "bX3mQ9s_0": None,  # role "bing"
    "bX3mQ9s_1": None,  # roles "user" / "chatgpt"
    "cT5vL1w_0": "turn 1 (assistant) is empty",
    "cT5vL1w_1": "empty or missing conversation",
    "dY8hP4z_0": "turns must alternate",
    "dY8hP4z_1": None,  # an unanswered last question is trimmed
    "eK2sW6n_0": None,  # "Human" / "GPT": roles match without case
    "eK2sW6n_1": "unknown role 'narrator'",
    "fM9tQ3r_0": "no user/assistant exchange",
    "gA4nV7c_0": None,  # non-ASCII text and emoji
    "hJ1pX5d_0": ("system message after the first turn", 1),  # the quiz's first exchange is kept
    "kL6rT8y_0": "turn 1 (assistant) is empty",  # "value": null
    "mN2bC4x_0": None,  # long: kept by the reader, truncated (or skipped) at tokenisation
    "pQ7wE3t_0": "1 <image> markers but 0 images",  # text that talks about an <image> tag
    "rS5yU1i_0": "content is not text",
}

LLAVA_EXPECTED = {
    "000000033471": None,  # coco, <image> at the start, two exchanges
    "2354786": None,  # int id, vg/VG_100K, <image> at the end of the first turn
    "2410931": None,  # int id, vg/VG_100K_2
    "1843920212": None,  # ocr_vqa
    "0054c91397f2fe05": None,  # textvqa
    "n161313": None,  # gqa
    "i6IyJda_0": None,  # text-only entry of the mix (no "image" field)
    "0439784549": None,  # an RGBA PNG cover
    "000000999999": None,  # image missing on disk: the reader keeps it, tokenisation skips it
    "000000122688": None,  # image without an <image> marker: the marker is prepended
    "000000555005": "1 <image> markers but 0 images",
    "2388812": None,  # a truncated download: the reader keeps it, tokenisation skips it
    "000000381231": "2 <image> markers but 1 images",
}


def read(path, image_root=None):
    """id -> what the reader yields last for it (the conversation, or why it is skipped);
    a truncated conversation is announced first by a BadSample with action "truncated"."""
    out = {}
    for r in read_conversations(path, "auto", image_root):
        sid = r.id if isinstance(r, BadSample) else r["id"]
        if isinstance(r, BadSample) and r.action == "truncated":
            out.setdefault("truncated", {})[sid] = r
            continue
        out[sid] = r
    return out


def check_expected(got: dict, expected: dict):
    truncated = got.pop("truncated", {})
    assert list(got) == list(expected)  # nothing dropped silently, file order kept
    for sid, want in expected.items():
        r = got[sid]
        if want is None or isinstance(want, tuple):
            assert not isinstance(r, BadSample), f"{sid} skipped: {r.message()}"
            assert (sid in truncated) == isinstance(want, tuple), sid
        if isinstance(want, tuple):
            note = truncated[sid]
            assert want[0] in note.reason and note.kept_exchanges == want[1], (sid, note)
            assert len([m for m in r["messages"] if m["role"] == "assistant"]) == want[1]
        elif want is not None:
            assert isinstance(r, BadSample), f"{sid} kept, expected skipped for {want!r}"
            assert want in r.reason, (sid, r.reason)
            assert r.fix and r.source.endswith(".json")


def test_sharegpt_quirks():
    got = read(SHAREGPT)
    check_expected(got, SHAREGPT_EXPECTED)
    roles = {sid: [m["role"] for m in r["messages"]] for sid, r in got.items() if not isinstance(r, BadSample)}
    assert roles["QWJhYvA_0"] == ["user", "assistant"] * 2
    assert roles["QWJhYvA_1"] == ["user", "assistant"] and got["QWJhYvA_1"]["messages"][0]["content"] == "And for a string?"
    assert roles["nR7fK2p_0"] == ["system", "user", "assistant"]
    assert roles["nR7fK2p_1"] == roles["bX3mQ9s_0"] == roles["bX3mQ9s_1"] == roles["eK2sW6n_0"] == ["user", "assistant"]
    assert roles["dY8hP4z_1"] == ["user", "assistant"]
    # markdown reaches the template verbatim
    assert "```python\nxs = [1, 2, 3]" in got["QWJhYvA_0"]["messages"][1]["content"]
    assert "| `reverse()` | no |" in got["QWJhYvA_0"]["messages"][1]["content"]
    assert all(r["images"] == [] for r in got.values() if not isinstance(r, BadSample))


def test_llava_mix_quirks():
    got = read(LLAVA, IMAGES)
    check_expected(got, LLAVA_EXPECTED)
    assert isinstance(got["2354786"]["id"], str)  # int ids become strings
    first = got["2354786"]["messages"][0]["content"]
    assert first.endswith(IMAGE_MARKER) and first.count(IMAGE_MARKER) == 1  # stays at the end
    assert got["000000122688"]["messages"][0]["content"].startswith(IMAGE_MARKER + "\n")
    assert got["i6IyJda_0"]["images"] == []
    for sid, sub in {"000000033471": "coco/train2017", "2354786": "vg/VG_100K", "2410931": "vg/VG_100K_2",
                     "1843920212": "ocr_vqa/images", "0054c91397f2fe05": "textvqa/train_images",
                     "n161313": "gqa/images"}.items():
        (img,) = got[sid]["images"]
        assert img.startswith(str(IMAGES / sub)) and Path(img).is_file()


def test_llava_mix_tokenised_as_training_does(llava_target):
    """build_split (what training runs) keeps the good samples and names why the others go."""
    split = build_split([{"path": str(LLAVA), "format": "auto", "image_root": str(IMAGES)}], llava_target, 512)
    kept = {r["id"]: r for r in split.dataset}
    skipped = {b.id: b.reason for b in split.skipped}
    assert set(kept) == {sid for sid, w in LLAVA_EXPECTED.items() if w is None} - {"000000999999", "2388812"}
    assert skipped["000000999999"].startswith("image 000000999999.jpg not found at ")
    assert skipped["2388812"].startswith("image cannot be decoded")
    assert skipped["000000555005"] == "1 <image> markers but 0 images"
    per_image = llava_target.tokens_per_image
    for sid, r in kept.items():
        assert r["n_visual"] == per_image * len(r["images"]), sid
        assert sum(r["loss_mask"]) > 0
    assert kept["i6IyJda_0"]["n_visual"] == 0
    # <image> at the end of the first turn: the visual block comes after that turn's text
    ids = kept["2354786"]["input_ids"]
    start = ids.index(llava_target.image_token_id)
    assert start > len(llava_target.tokenizer("Provide a one-sentence caption")["input_ids"])
    ids = kept["000000033471"]["input_ids"]
    assert ids.index(llava_target.image_token_id) < 10  # at the start: right after the role prefix


def test_sharegpt_tokenised_as_training_does(llava_target):
    split = build_split([{"path": str(SHAREGPT), "format": "sharegpt"}], llava_target, 4096)
    assert {r["id"] for r in split.dataset} == {sid for sid, w in SHAREGPT_EXPECTED.items()
                                                if w is None or isinstance(w, tuple)}
    assert len(split.skipped) == sum(w is not None for w in SHAREGPT_EXPECTED.values())
    # a loss only on assistant text: the system prompt and user turns carry none
    row = next(r for r in split.dataset if r["id"] == "nR7fK2p_0")
    text = llava_target.tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert "100 degrees Celsius" in text and "terse" not in text and "boiling" not in text


def test_on_bad_sample_error_names_file_sample_and_fix(llava_target):
    with pytest.raises(BadSampleError, match=r"sharegpt_excerpt.json, sample cT5vL1w_0: turn 1 \(assistant\) is "
                                             r"empty \(remove the empty turn"):
        build_split([{"path": str(SHAREGPT), "format": "auto"}], llava_target, 4096, on_bad_sample="error")
