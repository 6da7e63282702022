"""Regenerated training data (msd_train/data/regenerate.py) on the embedded tiny target:
interrupted and resumed, sharded, every conversation answered exactly once, in order."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from msd_train.config import REPO_ROOT
from msd_train.data.formats import read_conversations
from msd_train.data.regenerate import MERGED, RegenerateError, regenerate

SOURCE = REPO_ROOT / "data" / "tiny" / "sharegpt_train.json"


def settings(out, **kw):
    # sampled, so that a resume that redrew a conversation's answer would show
    return {"out": str(out), "inputs": [{"path": str(SOURCE), "format": "auto"}], "limit": 6, "max_new_tokens": 8,
            "max_turns": 2, "max_prompt_tokens": 512, "temperature": 0.8, "top_p": 1.0, "top_k": 0, "seed": 3,
            "progress": False, **kw}


@pytest.fixture(scope="module")
def target(one_thread):
    from msd_train.targets import load_target

    return load_target(str(REPO_ROOT / "data" / "tiny-llava"), "float32", "cpu")


@pytest.fixture(scope="module")
def reference(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen") / "ref"
    regenerate(target, settings(out))
    return merged(out)


def merged(out) -> list[dict]:
    """The merged records less their times (which differ from run to run)."""
    recs = [json.loads(line) for line in (out / MERGED).read_text().splitlines()]
    for r in recs:
        r["regenerated"].pop("seconds")
        r["regenerated"].pop("engine")
    return recs


class Killed(Exception):
    pass


def test_output_is_a_training_source_with_the_original_beside(reference):
    assert [r["n"] for r in reference] == list(range(6))
    original = [json.loads(SOURCE.read_text())[r["index"]] for r in reference]
    for rec, orig in zip(reference, original):
        assert rec["original"][0]["content"] == orig["conversations"][0]["value"]
        assert rec["messages"][0] == rec["original"][0]  # the user's question is kept
        assert rec["messages"][1]["role"] == "assistant" and 1 <= rec["regenerated"]["new_tokens"][0] <= 8
    read = [c for c in read_conversations(_write(reference)) if isinstance(c, dict)]
    assert [c["messages"] for c in read] == [r["messages"] for r in reference]


def _write(records):
    import tempfile

    path = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def test_kill_and_resume_answers_every_conversation_once_in_order(target, reference, tmp_path):
    out = tmp_path / "run"
    seen = []

    def kill_after_two(rec):
        seen.append(rec["n"])
        if len(seen) == 2:
            raise Killed

    with pytest.raises(Killed):
        regenerate(target, settings(out), on_record=kill_after_two)
    assert not (out / MERGED).exists()
    with open(out / "rank-0.jsonl", "a") as f:  # a kill in the middle of writing the third record
        f.write('{"id": "half a rec')
    resumed = []
    regenerate(target, settings(out), on_record=lambda r: resumed.append(r["n"]))
    assert resumed == [2, 3, 4, 5]  # the two finished ones are not redone, the cut one is
    assert merged(out) == reference


def test_ranks_share_the_work_and_any_world_size_resumes(target, reference, tmp_path):
    out = tmp_path / "run"

    def rank(r, world):
        return SimpleNamespace(rank=r, world=world, barrier=lambda: None)

    done = []
    regenerate(target, settings(out), rank(1, 2), on_record=lambda r: done.append(r["n"]))
    assert done == [1, 3, 5] and not (out / MERGED).exists()  # rank 1 leaves the merge to rank 0
    # rank 0 of that launch never ran; a one-process relaunch does its share only
    regenerate(target, settings(out), on_record=lambda r: done.append(r["n"]))
    assert done == [1, 3, 5, 0, 2, 4]
    assert merged(out) == reference


def test_a_conversation_left_with_no_exchange_is_not_merged(target, tmp_path):
    """max_prompt_tokens below the first prompt: nothing to train on, so no record (the
    readers refuse an empty conversation), but the manifest counts it."""
    assert regenerate(target, settings(tmp_path, limit=2, max_prompt_tokens=5))["unanswered"] == 2
    assert (tmp_path / MERGED).read_text() == ""


def test_other_settings_in_the_same_folder_are_refused(target, tmp_path):
    regenerate(target, settings(tmp_path, limit=1))
    with pytest.raises(RegenerateError, match="max_new_tokens: 8 there, 9 now"):
        regenerate(target, settings(tmp_path, limit=1, max_new_tokens=9))


@pytest.mark.slow
def test_command_line(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "regenerate_data.py"), f"out={out}", "limit=2",
           "max_new_tokens=4", "progress=false", "target.device=cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len((out / MERGED).read_text().splitlines()) == 2
    r = subprocess.run(cmd[:3] + ["limit=0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "limit=0 must be at least 1" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(cmd[:1] + cmd[1:2], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 1 and "out is not set" in r.stderr and not (tmp_path / "???").exists()


def test_an_edited_input_is_matched_by_content_not_position(target, reference, tmp_path):
    """Killed, its input edited (one conversation removed, one changed), relaunched: the
    removed one is left out of the merge, the changed one answered again, the rest kept."""
    rows = json.loads(SOURCE.read_text())[:8]
    first = tmp_path / "in.json"
    first.write_text(json.dumps(rows))
    out = tmp_path / "run"
    regenerate(target, settings(out, inputs=[{"path": str(first), "format": "auto"}], limit=None))
    before = {r["id"]: r for r in merged(out)}
    edited = [rows[0], rows[2], dict(rows[3], conversations=[dict(rows[3]["conversations"][0], value="Another question?"),
                                                            *rows[3]["conversations"][1:]]), *rows[4:]]
    first.write_text(json.dumps(edited))
    answered = []
    regenerate(target, settings(out, inputs=[{"path": str(first), "format": "auto"}], limit=None),
               on_record=lambda r: answered.append(r["original"][0]["content"]))
    after = merged(out)
    assert answered == ["Another question?"]  # only the changed conversation is answered again
    assert [r["original"][0]["content"] for r in after] == [c["conversations"][0]["value"] for c in edited][: len(after)]
    assert rows[1]["conversations"][0]["value"] not in [r["original"][0]["content"] for r in after]  # removed: not merged
    kept = [r for r in after if r["original"][0]["content"] != "Another question?"]
    assert all(r["messages"] == before[r["id"]]["messages"] for r in kept)


def test_a_damaged_progress_line_is_named_with_the_fix(target, tmp_path):
    regenerate(target, settings(tmp_path, limit=2))
    with open(tmp_path / "rank-0.jsonl", "a") as f:
        f.write("not json\n")
    with pytest.raises(RegenerateError, match=r"rank-0.jsonl, line 3: not a JSON record.*delete that line"):
        regenerate(target, settings(tmp_path, limit=2))


def test_binary_garbage_in_a_progress_file_is_named_with_the_line(tmp_path):
    """Bytes that are not UTF-8 in rank-*.jsonl (a disk error) were a UnicodeDecodeError naming no file."""
    from msd_train.data.regenerate import read_done

    (tmp_path / "rank-0.jsonl").write_bytes(b'{"id": "a", "key": "k1"}\n\xff\xfe\x00garbage\n')
    with pytest.raises(RegenerateError, match=r"rank-0.jsonl, line 2: not a JSON record.*delete that line"):
        read_done(tmp_path)


def test_batched_hf_engine_answers_like_the_decoder_when_greedy(target, tmp_path):
    """engine=hf batch_size>1: text prompts through transformers' batched generate(),
    left-padded; greedy answers equal the project's decoder one prompt at a time."""
    from msd_train.data.engines import HFEngine, Sampling

    one = regenerate(target, settings(tmp_path / "one", temperature=0.0, max_turns=1))
    batched = HFEngine(target, Sampling(8), batch_size=4)
    many = regenerate(target, settings(tmp_path / "many", temperature=0.0, max_turns=1), engine=batched)
    assert one["new_tokens"] == many["new_tokens"]
    assert [r["messages"] for r in merged(tmp_path / "one")] == [r["messages"] for r in merged(tmp_path / "many")]
    assert many["engines"] == {batched.name: 6} and "generate-batch4" in batched.name


@pytest.mark.slow
def test_engine_vllm_without_vllm_says_how_to_build_it(tmp_path):
    pytest.importorskip("transformers")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "regenerate_data.py"), f"out={tmp_path}", "engine=vllm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "scripts/vllm_env.sh" in r.stderr and "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_an_image_that_cannot_be_decoded_is_named_before_answering(target, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "x", "images": ["bad.png"], "messages": [
        {"role": "user", "content": "<image>\nWhat is this?"}, {"role": "assistant", "content": "A cat."}]}) + "\n")
    answered = []
    with pytest.raises(RegenerateError, match=r"conversation 'x': image .*bad.png cannot be decoded"):
        regenerate(target, settings(tmp_path / "out", inputs=[{"path": str(src), "format": "auto"}], limit=None),
                   on_record=answered.append)
    assert answered == []


def test_engine_vllm_of_another_release_or_past_the_window_is_refused(monkeypatch):
    """vLLM of a release this project was not checked against, or a prompt budget beyond the
    target's context window: refused with the fix, before an engine starts."""
    import importlib.metadata

    from msd_train.data.engines import EngineError, Sampling
    from msd_train.serving import regenerate as served

    def version(dist):
        if dist == "vllm":
            return "0.99.1"
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(EngineError, match=r"vLLM 0.99.1 is installed.*scripts/vllm_env.sh"):
        served.vllm_version()
    monkeypatch.setattr(served, "vllm_version", lambda: "0.32.0")
    target = SimpleNamespace(adapter=None, dtype=None, text_config=SimpleNamespace(max_position_embeddings=2048))
    with pytest.raises(EngineError, match="2304 is longer than the target's context window \\(2048"):
        served.VLLMEngine(target, "unused", Sampling(256), max_model_len=2304)
