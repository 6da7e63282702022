"""Serving without surprises, on a real vLLM engine and the embedded tiny LLaVA:

* a head that compresses its visual context is refused by the vLLM export and by the
  plugin, with a message naming the setting and the format that keeps it;
* ``scripts/serve_check.py`` and ``eval.py`` on one benchmark generate the same length and
  say so, and vLLM's counters with the plugin equal what eval.py measures on the head as
  it was before export;
* the model card's "Serve with vLLM" snippet runs as written, for an msd and an msd3 head.

Needs vLLM: it runs in the environment scripts/vllm_env.sh builds and skips elsewhere:

    bash scripts/vllm_env.sh .venv-vllm
    .venv-vllm/bin/python -m pytest -q tests/serving/test_vllm_export.py
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; build its environment with scripts/vllm_env.sh "
                                   "and run this file with that environment's python")

import torch  # noqa: E402
from builders.heads import train_head

from msd_train.draft import MSD3DraftConfig, MSD3DraftModel, MSDDraftConfig, MSDDraftModel  # noqa: E402
from msd_train.serving.check import CPU_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "data" / "tiny-llava"
ENV = {**os.environ, **{k: os.environ.get(k, v) for k, v in CPU_ENV.items()}}


def _run(args, cwd=ROOT, timeout=900):
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args[:2]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def test_a_compressing_head_is_refused_by_the_export_and_by_the_plugin(tmp_path):
    from transformers import AutoConfig

    from msd_train.hub.vllm import export_vllm
    from msd_train.serving.vllm_models import check_block

    config = MSDDraftConfig.from_target_config(AutoConfig.from_pretrained(str(TARGET)), str(TARGET),
                                               visual_compression="pool", visual_compression_tokens=8)
    with pytest.raises(ValueError, match=r"format=vllm cannot serve this msd head as it was trained: "
                                         r"visual_compression=pool \(visual_compression_tokens=8\).*format=msd keeps"):
        export_vllm(MSDDraftModel(config), tmp_path / "h")
    # a folder written by hand (or before the export refused) with the setting in its block
    block = {"architecture": "msd", "decouple_visual": True, "visual_offset": "released",
             "visual_compression": "pool", "visual_compression_tokens": 8}
    with pytest.raises(ValueError, match="plugin of msd-train cannot serve this msd head.*visual_compression=pool"):
        check_block(block)
    check_block({**block, "visual_compression": "none"})


def _mmspec_folder(root: Path) -> Path:
    """An MMSpec-shaped split (mmspec.jsonl + images/): one image turn, one text turn."""
    (root / "images").mkdir(parents=True)
    shutil.copy(ROOT / "data/tiny/images/shapes/heldout_00000.png", root / "images" / "a.png")
    records = [{"id": "img", "image": "a.png", "turns": ["What shape is in the picture?"], "topic": "general vqa"},
               {"id": "txt", "image": None, "turns": ["Name three colours."], "topic": "multi-turn conversation"}]
    (root / "mmspec.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def test_serve_check_and_eval_measure_the_same_length_and_the_same_counters(tmp_path):
    """bench=mmspec fixes the generation length (1024 by default; 12 here, for time): both
    commands take the benchmark's, over their own default (64), and print it. The serving
    check decodes with the head given before export, so vLLM's counters (plugin) are set
    beside what eval.py measures on that head."""

    from msd_train.evaluation.bench import load_bench
    from msd_train.hub.vllm import export_vllm
    from msd_train.targets import load_target

    bench = _mmspec_folder(tmp_path / "mmspec")
    target = load_target(str(TARGET), "float32", torch.device("cpu"))
    items = load_bench({"kind": "jsonl", "path": str(bench), "group_by": "topic"})
    prompts = [target.encode_prompt([{"role": "user", "content": it.turns[0]}], it.load_images()) for it in items]
    train_head(target, prompts, steps=80).save_pretrained(tmp_path / "head")  # format=msd: what eval.py reads
    export_vllm(tmp_path / "head", tmp_path / "head-vllm")

    common = ["bench=mmspec", f"bench.path={bench}", "bench.max_new_tokens=12"]
    said = _run(["scripts/serve_check.py", f"draft={tmp_path / 'head-vllm'}", f"original={tmp_path / 'head'}", "k=4",
                 "modes=[plugin]", f"out={tmp_path / 'check'}", f"cache={tmp_path / 'cache'}", *common])
    check = json.loads((tmp_path / "check" / "report.json").read_text())
    said_eval = _run(["eval.py", f"draft={tmp_path / 'head'}", f"out={tmp_path / 'eval'}", "decoding=chain",
                      "decoding.k=4", "warmup=0", "progress=false", *common])
    ev = json.loads((tmp_path / "eval" / "report.json").read_text())

    assert check["settings"]["max_new_tokens"] == ev["decoding"]["max_new_tokens"] == 12
    assert "bench=mmspec: up to 12 new tokens a turn" in said and "bench=mmspec: up to 12 new tokens a turn" in said_eval
    assert check["project"]["head"] == "original" and check["project"]["export_differs"] == []
    assert check["turns"] == 2
    # the same decoder on the same head and prompts: eval.py's tau, count for count
    assert check["project"]["tau"] == pytest.approx(ev["overall"]["tau"], abs=1e-9)
    plugin = check["vllm"]["plugin"]
    assert plugin["outputs_equal_project_ar"] == check["turns"]
    assert plugin["mean_acceptance_length"] == pytest.approx(ev["overall"]["tau"], abs=0.05)


def _card_snippet(config, repo_id: str) -> str:
    from msd_train.hub.card import model_card

    card = model_card(config, repo_id, [])
    section = card[card.index("## Serve with vLLM"):card.index("## Head")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, section
    return blocks[0]


@pytest.mark.parametrize("architecture", ["msd", "msd3"])
def test_the_model_cards_vllm_snippet_runs_as_written(tmp_path, architecture):
    """The card of a head pushed as me/head, for the embedded target (a local folder, which
    vLLM 0.32 cannot load as transformers saved it): the snippet, run in a folder where
    me/head and the card's path/to/tiny-llava are (the Hub and the user's copy), exports
    the head, converts the target and generates."""
    from transformers import AutoConfig

    config_cls, head_cls = (MSD3DraftConfig, MSD3DraftModel) if architecture == "msd3" else (MSDDraftConfig,
                                                                                                MSDDraftModel)
    config = config_cls.from_target_config(AutoConfig.from_pretrained(str(TARGET)), str(TARGET))
    torch.manual_seed(0)
    head_cls(config).save_pretrained(tmp_path / "me" / "head")
    (tmp_path / "path" / "to").mkdir(parents=True)
    (tmp_path / "path" / "to" / "tiny-llava").symlink_to(TARGET)

    snippet = _card_snippet(config, "me/head")
    assert 'vllm_target("path/to/tiny-llava"' in snippet
    _run(["-c", snippet], cwd=tmp_path)
    assert (tmp_path / "head-vllm" / "config.json").is_file() and (tmp_path / "vllm-target").is_dir()
