"""The data path at scale: visual counts without pixels, the cheap image check, the
Python-rendered built-in templates, and the cache found without reading the data."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from msd_train.data.dataset import build_split, image_size, load_images, truncate
from msd_train.data.formats import BadSampleError, read_conversations
from msd_train.targets import chat

ROOT = Path(__file__).resolve().parents[2]
SIZES = [(640, 480), (500, 375), (1024, 768), (48, 48), (333, 1000), (20, 700), (1, 1), (4000, 3000)]


def _image(size, seed=0):
    w, h = size
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _conversations():
    return [
        [{"role": "user", "content": "<image>\nWhat is this?"}, {"role": "assistant", "content": "A red circle."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and <image> that?"},
         {"role": "assistant", "content": "two\nlines"}],
        [{"role": "user", "content": "  spaces  "}, {"role": "assistant", "content": "{{ not jinja }}"},
         {"role": "user", "content": "<image>\n<image>\ncompare"}, {"role": "assistant", "content": "same"}],
    ]


@pytest.mark.parametrize("template", [chat.VICUNA_V1, chat.CHATML_QWEN, chat.SMOLLM2_CHATML],
                         ids=["vicuna_v1", "chatml_qwen", "smollm2"])
def test_python_templates_render_what_their_jinja_source_renders(template, monkeypatch):
    special = {"eos_token": "</s>", "bos_token": "<s>"}
    fast = [chat.render_segments(m, template, "<IMG>", "</s>", **special) for m in _conversations()]
    prompts = [chat.render_prompt(m, template, "<IMG>", **special) for m in _conversations()]
    monkeypatch.setattr(chat, "_PYTHON_TEMPLATES", {})
    assert fast == [chat.render_segments(m, template, "<IMG>", "</s>", **special) for m in _conversations()]
    assert prompts == [chat.render_prompt(m, template, "<IMG>", **special) for m in _conversations()]
    monkeypatch.undo()
    for m in _conversations():
        for n in range(len(m) + 1):
            for gen in (True, False):
                assert chat._render(template, m[:n], gen, **special) == \
                    chat._compiled(template).render(messages=m[:n], add_generation_prompt=gen, **special)


def test_smollm2_folder_template_is_the_python_one():
    folder = ROOT / "data" / "smollm2-llava" / "chat_template.jinja"
    if not folder.is_file():
        pytest.skip("data/smollm2-llava is built by python -m lab.targets.make_smollm2_llava")
    assert folder.read_text() == chat.SMOLLM2_CHATML


def _embedded():
    from msd_train.targets import load_target

    return load_target(str(ROOT / "data" / "tiny-llava"))


def _lab_qwen(tmp_path_factory):
    from lab.targets.tiny_qwen import save_tiny_qwen2vl
    from msd_train.targets import load_target

    out = save_tiny_qwen2vl(tmp_path_factory.mktemp("tiny_qwen"), ROOT / "data" / "tiny-llava")
    return load_target(str(out), chat_template="chatml_qwen")


@pytest.fixture(scope="module")
def targets(llava_target, qwen_target, tmp_path_factory):
    from builders import tiny_qwen25vl_target

    from lab.targets.random import random_target
    from msd_train.targets import wrap_target

    out = {"llava": llava_target, "qwen2_vl": qwen_target, "qwen2_5_vl": tiny_qwen25vl_target(),
           "embedded": _embedded(), "lab_tiny_qwen": _lab_qwen(tmp_path_factory)}
    from msd_train.targets import FAMILIES, transformers_at_least

    for family in ("llava_next", "qwen3_vl"):
        if FAMILIES[family].min_transformers and not transformers_at_least(FAMILIES[family].min_transformers):
            continue  # the floor run: that family's adapter needs a newer transformers
        model, proc = random_target(family)
        out[family] = wrap_target(model, proc, f"tiny-random-{family}")
    return out


@pytest.mark.parametrize("which", ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "embedded",
                                   "lab_tiny_qwen"])
def test_visual_counts_from_the_size_equal_the_processors(targets, which):
    if which not in targets:
        pytest.skip(f"{which} needs a newer transformers")
    target = targets[which]
    images = [_image(s, i) for i, s in enumerate(SIZES)]
    _, want = target.image_inputs(images)
    assert target.image_token_counts(SIZES) == list(want)


def test_image_size_reads_the_header_and_catches_cut_files(tmp_path):
    for fmt, ext in (("JPEG", "jpg"), ("PNG", "png"), ("GIF", "gif"), ("BMP", "bmp")):
        p = tmp_path / f"a.{ext}"
        _image((64, 40)).save(p, fmt)
        assert image_size(str(p)) == (64, 40)
        data = p.read_bytes()
        p.write_bytes(data[: len(data) * 2 // 3])
        with pytest.raises(ValueError, match="cut short|truncated|Error"):
            image_size(str(p))
    with pytest.raises(FileNotFoundError):
        image_size(str(tmp_path / "nope.jpg"))


def _mm_data(tmp_path, n=6):
    img = tmp_path / "img"
    img.mkdir(exist_ok=True)
    recs = []
    for i in range(n):
        _image(SIZES[i % len(SIZES)] if i % 3 else (64, 48), i).save(img / f"{i}.jpg", quality=80)
        recs.append({"id": f"s{i}", "image": f"{i}.jpg", "conversations": [
            {"from": "human", "value": "<image>\nwhat is it?"}, {"from": "gpt", "value": f"a red circle {i}"},
            {"from": "human", "value": "sure?"}, {"from": "gpt", "value": "yes"}]})
    recs.append({"id": "text", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    data = tmp_path / "mm.json"
    data.write_text(json.dumps(recs))
    return [{"path": str(data), "format": "auto", "image_root": str(img)}]


@pytest.mark.parametrize("which", ["embedded", "qwen2_vl", "llava_next"])
def test_rows_equal_the_pixel_path(targets, which, tmp_path):
    """Token ids, loss masks and visual counts are those of encoding with the decoded images."""
    target = targets[which]
    src = _mm_data(tmp_path)
    split = build_split(src, target, 100000, cache_dir=str(tmp_path / "cache"), num_proc=2)
    assert not split.skipped and len(split) == 7
    rows = {r["id"]: r for r in split.dataset}
    for rec in read_conversations(src[0]["path"], "auto", src[0]["image_root"]):
        enc = target.encode(rec["messages"], load_images(rec["images"]))
        ids, mask, _ = truncate(enc.input_ids, enc.loss_mask, target.image_token_id, 100000)
        r = rows[rec["id"]]
        assert r["input_ids"] == ids.tolist() and r["loss_mask"] == mask.tolist(), rec["id"]
        assert r["n_visual"] == int((ids == target.image_token_id).sum())


def test_the_embedded_data_gives_the_same_rows_as_the_pixel_path(targets):
    target = targets["embedded"]
    src = [{"path": str(ROOT / "data/tiny/llava_train.json"), "format": "auto",
            "image_root": str(ROOT / "data/tiny/images")}]
    split = build_split(src, target, 512, limit=40)
    assert len(split) == 40
    for r, rec in zip(split.dataset, (x for x in read_conversations(src[0]["path"], "auto", src[0]["image_root"]))):
        enc = target.encode(rec["messages"], load_images(rec["images"]))
        assert r["id"] == rec["id"] and r["input_ids"] == enc.input_ids[:512].tolist()


def test_a_cut_image_is_named_with_its_sample_and_fix_before_training(llava_target, tmp_path):
    src = _mm_data(tmp_path)
    p = tmp_path / "img" / "4.jpg"
    p.write_bytes(p.read_bytes()[:-300])
    with pytest.raises(BadSampleError, match=r"mm.json, sample s4: image cannot be decoded \(4.jpg: the file is cut "
                                             r"short.*re-download or remove the image .*4.jpg"):
        build_split(src, llava_target, 4096, "error", str(tmp_path / "cache"))
    split = build_split(src, llava_target, 4096, "skip", str(tmp_path / "cache"))
    assert [b.id for b in split.skipped] == ["s4"] and len(split) == 6


def test_warm_launch_parses_no_data_file_and_digests_it_once(llava_target, tmp_path, monkeypatch):
    import msd_train.data.dataset as dataset

    src = _mm_data(tmp_path)
    cold = build_split(src, llava_target, 4096, cache_dir=str(tmp_path / "cache"))

    def no_reading(*a, **k):
        raise AssertionError("the data file was parsed on a warm launch")

    monkeypatch.setattr(dataset, "read_conversations", no_reading)
    monkeypatch.setattr(dataset, "_DIGESTS", {})  # a new launch's process
    digests, new = [], hashlib.new
    monkeypatch.setattr(hashlib, "new", lambda *a, **k: digests.append(a) or new(*a, **k))
    warm = build_split(src, llava_target, 4096, cache_dir=str(tmp_path / "cache"))
    assert warm.dataset["input_ids"] == cold.dataset["input_ids"]
    dataset.file_digest(src[0]["path"])  # the resume check and the run's record ask again: not read again
    assert digests == [("sha1",)]
    assert all(len(f["filename"]) for f in warm.dataset.cache_files)  # memory-mapped Arrow, not in memory


def test_the_token_counts_are_kept_with_the_cache_and_leave_out_a_row_whose_image_went_away(
        llava_target, tmp_path, monkeypatch):
    """The draft vocabulary's counts read every row's ids at each launch (32 s at 733k rows): the
    first launch keeps them in the cache folder, the next reads no ids; a row dropped since (its
    image deleted) is counted out, not served from the stale file."""
    import msd_train.draft.vocabulary as vocabulary
    from msd_train.draft.vocabulary import token_counts

    src, cache = _mm_data(tmp_path), str(tmp_path / "cache")
    cold = build_split(src, llava_target, 4096, cache_dir=cache)
    fresh = token_counts([cold.dataset], llava_target.vocab_size)
    assert torch.equal(cold.token_counts(llava_target.vocab_size), fresh) and fresh.sum() > 20

    def no_counting(*a, **k):
        raise AssertionError("a warm launch read the ids to count them")

    monkeypatch.setattr(vocabulary, "token_counts", no_counting)
    warm = build_split(src, llava_target, 4096, cache_dir=cache)
    assert torch.equal(warm.token_counts(llava_target.vocab_size), fresh)
    monkeypatch.undo()
    (tmp_path / "img" / "2.jpg").unlink()
    fewer = build_split(src, llava_target, 4096, cache_dir=cache)
    assert [b.id for b in fewer.skipped] == ["s2"] and fewer.counts_home is None  # the trainer counts these rows
    assert torch.equal(fewer.token_counts(llava_target.vocab_size),
                       token_counts([fewer.dataset], llava_target.vocab_size))
    assert not torch.equal(fewer.token_counts(llava_target.vocab_size), fresh)
    assert build_split(src, llava_target, 4096).counts_home is None  # no cache: nothing kept


def test_a_touched_file_keeps_its_cache_and_a_changed_one_is_tokenised_again(llava_target, tmp_path, caplog):
    src = _mm_data(tmp_path)
    cache = str(tmp_path / "cache")
    first = build_split(src, llava_target, 4096, cache_dir=cache)
    data = Path(src[0]["path"])
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    with caplog.at_level(logging.INFO, logger="msd_train.data.dataset"):
        again = build_split(src, llava_target, 4096, cache_dir=cache)
    assert "tokenising again" not in caplog.text and len(list(Path(cache).glob("split-*"))) == 1
    assert again.dataset["input_ids"] == first.dataset["input_ids"]
    text = data.read_text().replace("a red circle 1", "a red square 1")  # same size, other content
    data.write_text(text)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="msd_train.data.dataset"):
        changed = build_split(src, llava_target, 4096, cache_dir=cache)
    assert "the data files changed since; tokenising again" in caplog.text
    assert changed.dataset["input_ids"] != first.dataset["input_ids"]


def test_a_cache_of_another_target_or_version_is_not_used(llava_target, targets, tmp_path, caplog, monkeypatch):
    import msd_train.data.dataset as dataset

    src = _mm_data(tmp_path)
    cache = str(tmp_path / "cache")
    build_split(src, llava_target, 4096, cache_dir=cache)
    with caplog.at_level(logging.INFO, logger="msd_train.data.dataset"):
        other = build_split(src, targets["embedded"], 4096, cache_dir=cache)
    assert "written for another target or tokenizer (tiny-random-llava" in caplog.text
    enc = targets["embedded"].encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    assert other.dataset[len(other) - 1]["input_ids"] == enc.input_ids.tolist()
    caplog.clear()
    monkeypatch.setattr(dataset, "CACHE_VERSION", dataset.CACHE_VERSION + 1)
    with caplog.at_level(logging.INFO, logger="msd_train.data.dataset"):
        build_split(src, llava_target, 4096, cache_dir=cache)
    assert f"written by another version of this code (cache version {dataset.CACHE_VERSION - 1}" in caplog.text
    caplog.clear()
    monkeypatch.setattr(dataset, "_code_digest", lambda: "edited")  # the same version number, other code
    with caplog.at_level(logging.INFO, logger="msd_train.data.dataset"):
        build_split(src, llava_target, 4096, cache_dir=cache)
    assert "written by another version of this code" in caplog.text and "now edited" in caplog.text
    # a manifest edited to claim another identity is refused, not used
    entry = sorted(Path(cache).glob("split-*"), key=lambda p: p.stat().st_mtime)[-1]
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["identity"]["target"] = "someone-else"
    (entry / "manifest.json").write_text(json.dumps(manifest))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="msd_train.data.dataset"):
        build_split(src, llava_target, 4096, cache_dir=cache)
    assert "does not belong to this launch" in caplog.text


@pytest.mark.parametrize("which", ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "embedded",
                                   "lab_tiny_qwen"])
def test_the_tokenizers_batch_call_gives_its_own_ids(targets, which):
    """The cold path asks the Rust tokenizer directly: the same ids as the tokenizer's own call,
    special tokens, placeholders, odd spacing and non-ASCII text included."""
    from msd_train.targets.tokenize import tokenize_texts

    if which not in targets:
        pytest.skip(f"{which} needs a newer transformers")
    tok = targets[which].tokenizer
    texts = ["hello world", "  two  spaces\n\nand lines\t", " USER: <image>\nWhat is it? ASSISTANT: a cat</s>",
             "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n", "café ½ 東京 🙂", "",
             tok.eos_token or "", "x" * 300]
    assert tokenize_texts(tok, texts) == tok(texts, add_special_tokens=False)["input_ids"]


def test_a_json_array_is_read_a_chunk_at_a_time(tmp_path, monkeypatch):
    """Records cut anywhere by the chunks come out whole; the file is never read in one piece
    (``read_text`` is only for naming an error); a break names its line as json does."""
    import msd_train.data.formats as formats

    recs = [{"id": i, "conversations": [{"from": "human", "value": "é" * i + "\n"}], "n": i * 1.5e-3, "ok": i % 2 == 0}
            for i in range(40)]
    p = tmp_path / "a.json"
    p.write_text("\ufeff" + json.dumps(recs, indent=1, ensure_ascii=False), encoding="utf-8")
    monkeypatch.setattr(formats, "_CHUNK", 7)
    monkeypatch.setattr(formats, "read_text", lambda path: pytest.fail("the whole file was read"))
    assert [r for _, r in formats.read_records(p)] == recs
    monkeypatch.undo()
    monkeypatch.setattr(formats, "_CHUNK", 7)
    text = p.read_text(encoding="utf-8-sig")
    p.write_text(text[: text.index('"id": 30')] + '"id": 30 "x": 1}]', encoding="utf-8")
    got = []
    with pytest.raises(ValueError, match=r"a.json: not valid JSON \(Expecting ',' delimiter at line \d+, column \d+\)"):
        got.extend(r for _, r in formats.read_records(p))
    assert got == recs[:30]
