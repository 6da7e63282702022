"""A dflash head served by vLLM through this project's plugin, on the embedded tiny LLaVA:
fitted to the target's answers to three image prompts, exported with format=vllm (vLLM's
DFlash layout under the plugin's ``DFlashMSDDraftModel``) and run by vLLM without and with
the head, as the serving check runs it (msd_train/serving/check.py).

The head keeps MSD's decoupled visual tokens (its context reads the target's visual
embeddings at image positions) and drafts over a draft vocabulary (``train_vocab``); vLLM
drafts the blocks the project's ``decoding=block`` drafts, count for count, and its outputs
are its plain decoding's. Stock vLLM (no plugin) refuses the folder.

Needs vLLM: it runs in the environment scripts/vllm_env.sh builds and skips elsewhere:

    bash scripts/vllm_env.sh .venv-vllm
    .venv-vllm/bin/python -m pytest -q tests/serving/test_vllm_dflash.py
"""

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; build its environment with scripts/vllm_env.sh "
                                   "and run this file with that environment's python")

import torch  # noqa: E402
from builders import TINY_IMAGE_BENCH as BENCH
from builders import TINY_TARGET as TARGET
from builders.heads import train_dflash_head

from msd_train.hub.vllm import export_vllm  # noqa: E402
from msd_train.serving import check  # noqa: E402
from msd_train.serving.target import vllm_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BLOCK, NEW = 4, 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The head (block 4, one layer, decoupled visual tokens), exported; the project's plain
    and block decoding of the benchmark; vLLM plain, vLLM with the head and the plugin.

    Its draft vocabulary leaves out the two tokens the target's answers use most (token
    counts that put them last), which the fitted head proposes and gets accepted: drafting
    over the whole vocabulary instead would accept otherwise."""
    from msd_train.decoding import DecodeConfig, generate
    from msd_train.evaluation.bench import load_bench
    from msd_train.targets import load_target

    root = tmp_path_factory.mktemp("vllm-dflash")
    target = load_target(str(TARGET), "float32", torch.device("cpu"))
    prompts = [target.encode_prompt([{"role": "user", "content": it.turns[0]}], it.load_images())
               for it in load_bench(BENCH)]
    head = train_dflash_head(target, prompts, steps=40, block_size=BLOCK, num_hidden_layers=1)
    assert head.config.decouple_visual
    answers = [generate(target, None, p, DecodeConfig(method="ar", max_new_tokens=NEW)).tokens for p in prompts]
    counts = torch.bincount(torch.tensor([t for a in answers for t in a]), minlength=target.vocab_size)
    head.token_counts = torch.ones_like(counts)
    head.token_counts[counts.argsort(descending=True)[:2]] = 0
    head.config.train_vocab = target.vocab_size - 2
    export_vllm(head, root / "head")
    got = check.project_prompts({"name_or_path": str(TARGET), "dtype": "float32"}, BENCH, str(root / "head"),
                                BLOCK - 1, NEW)
    spec = {"target": str(vllm_target(TARGET, root / "cache")), "k": BLOCK - 1, "max_new_tokens": NEW,
            "dtype": "float32", "max_model_len": 512, "turns": got["turns"], "max_images": 1, "method": "dflash"}
    runs = {mode: check.vllm_process({**spec, "draft": None if mode == "ar" else str(root / "head")}, mode, root)
            for mode in ("ar", "plugin")}
    return got, runs, check.compare(got, runs), spec, root


def test_vllm_serves_the_dflash_export_losslessly_through_the_plugin(served):
    got, runs, report, _, _ = served
    n = len(got["turns"])
    assert n == 3 and all(t["images"] for t in got["turns"]) and got["project"]["decoding"] == "block"
    vllm = report["vllm"]
    assert vllm["ar"]["outputs_equal_project_ar"] == n
    plugin = vllm["plugin"]
    assert plugin["outputs_equal_vllm_ar"] == n and plugin["outputs_equal_project_ar"] == n
    assert plugin["draft_class"] == "MSDDFlashForCausalLM"
    assert plugin["counters"]["num_drafts"] > 0 and plugin["counters"]["num_accepted_tokens"] > 0


def test_vllm_drafts_the_blocks_the_projects_decoder_drafts(served):
    """Same head, prompts and block, fp32 on both sides: each turn, vLLM's draft rounds and
    accepted tokens are the project's block cycles and accepted tokens, count for count (a
    tau tolerance would not do: without the visual path vLLM's tau here moved by less than
    the 0.05 tests/serving/test_vllm_serving.py allows)."""
    got, runs, report, _, _ = served
    for turn, counters in zip(got["turns"], runs["plugin"]["per_turn"]):
        assert (counters["num_drafts"], counters["num_accepted_tokens"]) == (len(turn["accepted"]),
                                                                            sum(turn["accepted"])), turn["id"]
    plugin = report["vllm"]["plugin"]
    assert plugin["mean_acceptance_length"] == pytest.approx(report["project"]["tau"], abs=1e-9)
    assert plugin["per_position"] == pytest.approx(report["project"]["per_position"], abs=1e-9)
    assert report["project"]["chain_equals_ar"] == len(got["turns"])


def test_stock_vllm_refuses_the_dflash_export(served):
    """Without the plugin vLLM has no class for the folder's architecture: it stops, rather
    than draft with its own DFlash layers (Qwen3's q/k norms, which the head lacks)."""
    _, _, _, spec, root = served
    with pytest.raises(RuntimeError, match=r"vLLM \(stock\) exited") as info:
        check.vllm_process({**spec, "draft": str(root / "head")}, "stock", root)
    assert "DFlashMSDDraftModel" in str(info.value) + (root / "stock.log").read_text()


def test_a_k_other_than_the_trained_block_is_refused_naming_the_fix(served):
    """vLLM's block is the root and k masks attending to each other both ways: only
    k = block_size - 1 is the block the head was trained on. The plugin refuses another k
    when the draft loads; the serving check refuses it before vLLM starts."""
    import subprocess
    import sys

    _, _, _, spec, root = served
    with pytest.raises(RuntimeError, match=r"vLLM \(plugin-k2\) exited"):
        check.vllm_process({**spec, "k": 2, "draft": str(root / "head")}, "plugin-k2", root)
    log = (root / "plugin-k2.log").read_text()
    assert "num_speculative_tokens=2: this dflash head was trained on blocks of 4" in log
    assert "give num_speculative_tokens=3" in log
    done = subprocess.run([sys.executable, "scripts/serve_check.py", f"draft={root / 'head'}", "k=5",
                           f"out={root / 'check'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    assert "k=5: a dflash export drafts its whole block in vLLM (block_size 4): give k=3" in done.stdout + done.stderr
    assert not (root / "check").exists()
