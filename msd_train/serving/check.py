"""The serving check: one head, one benchmark, this project's chain decoder beside vLLM.

    project   plain and chain-k decoding (block: a head that drafts a block, dflash) of every
              benchmark turn (``evaluation.runner``):
              the prompts (token ids + images) every engine below is given, the plain
              outputs, and the chain's tau, with the head as it was before export when
              the check is given it (what eval.py measures), else the re-imported export
    vllm-ar   vLLM, no speculation: outputs and tokens/s
    plugin    vLLM with the head (this project's plugin loaded): outputs, tokens/s and
              vLLM's own counters (``LLM.get_metrics()``)
    stock     vLLM with the same folder and no plugin (``VLLM_PLUGINS`` names none of
              ours): "compatible" mode (msd and msd3 exports; stock vLLM refuses a dflash one)

Each vLLM run is its own process (``python -m msd_train.serving.check vllm ...``): a
plugin, once loaded, stays registered in a process, and a process per engine frees each
engine's memory before the next.

The same accounting everywhere. vLLM counts per draft round (one per verification
forward of a request): ``num_drafts`` rounds, ``num_accepted_tokens`` accepted draft
tokens, so its mean acceptance length is 1 + accepted / drafts, the bonus token counted
once per round. The project's chain tau (``Generation.tau``) is tokens per verification
forward: sum over cycles of (accepted + 1) / cycles, the same quantity. Both count a
round's accepted tokens before a stop (eos, max tokens) truncates them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: vLLM settings for the CPU build (shared/REFERENCE.md), set unless the caller set them
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
MODES = ("ar", "plugin", "stock")


# ----- the project's side --------------------------------------------------------------

#: head settings that change what a head drafts, compared between the original head and its export
DRAFTING_FIELDS = ("num_hidden_layers", "layer_family", "fc_bias", "first_layer_input_norm", "decouple_visual",
                   "visual_offset", "draft_positions", "visual_compression", "visual_compression_tokens",
                   "mrope_section", "feature_layers", "draft_vocab_size")


def export_differences(original, exported) -> list[str]:
    """What differs between a head and the head re-imported from its vLLM export: drafting
    settings (``DRAFTING_FIELDS``), then tensors (names, then values in the export's dtype)."""
    out = []
    for k in DRAFTING_FIELDS:
        a, b = getattr(original.config, k, None), getattr(exported.config, k, None)
        if a != b:
            out.append(f"{k}: {a!r} in the original head, {b!r} in the export")
    if type(original) is not type(exported):
        out.append(f"architecture: {original.architecture} in the original head, {exported.architecture} in the export")
        return out
    a = {k: v for k, v in original.state_dict().items() if "rotary_emb" not in k}
    b = {k: v for k, v in exported.state_dict().items() if "rotary_emb" not in k}
    if a.keys() != b.keys():
        out.append(f"tensors: {sorted(a.keys() ^ b.keys())[:6]} are in one head only")
    else:
        differ = [k for k in a if not a[k].to(b[k].dtype).equal(b[k])]
        if differ:
            out.append(f"tensors: {len(differ)} differ (e.g. {differ[0]}; an export cast to another dtype differs)")
    return out


def project_prompts(target_cfg: dict, bench_cfg: dict, draft: str, k: int, max_new_tokens: int,
                    head: str | None = None) -> dict:
    """Every benchmark turn's prompt, plain output and chain-k figures from this project's
    decoder. ``head``: the head as it was before export (a folder or Hub id ``load_head``
    opens; what eval.py measures), whose chain figures the plugin's counters are compared
    with; None: the head re-imported from the exported folder ``draft``
    (``msd_train.hub.vllm.import_vllm``). The compatible mode is always the export's, and
    only for exports stock vLLM serves (``VllmLayout.stock_mode``). A head that drafts a block
    (``decoding_methods`` ("block",): dflash) decodes with ``decoding=block``, else chain."""
    import torch

    from msd_train.decoding import DecodeConfig
    from msd_train.evaluation.bench import load_bench
    from msd_train.evaluation.runner import answer_turns
    from msd_train.hub.load import load_head
    from msd_train.hub.vllm import import_vllm, vllm_layout
    from msd_train.targets import load_target

    target = load_target(target_cfg["name_or_path"], target_cfg.get("dtype", "auto"), torch.device("cpu"),
                         target_cfg.get("adapter"), target_cfg.get("chat_template"),
                         bool(target_cfg.get("trust_remote_code", False)), "sdpa")
    exported = import_vllm(draft)
    differs = []
    if head is not None:
        original = load_head(str(head), target)
        differs = export_differences(original, exported)
        spec_head = original.to(target.dtype)
    else:
        spec_head = import_vllm(draft).to(target.dtype)
    layout = vllm_layout(exported.config)
    compatible = compatible_head(exported.to(target.dtype), target) if layout.stock_mode else None
    methods = getattr(spec_head, "decoding_methods", ("tree", "chain"))
    method = "chain" if "chain" in methods else methods[0]
    chain = DecodeConfig(method=method, k=k, max_new_tokens=max_new_tokens)
    ar = dataclasses.replace(chain, method="ar")
    turns, t_chain, t_ar = [], 0.0, 0.0
    for item in load_bench(bench_cfg):
        images = item.load_images()
        t0 = time.perf_counter()
        plain = answer_turns(target, None, item, ar, images)
        t1 = time.perf_counter()
        spec = answer_turns(target, spec_head, item, chain, images)
        t_ar, t_chain = t_ar + t1 - t0, t_chain + time.perf_counter() - t1
        compat = ([(None, None)] * len(plain) if compatible is None
                  else answer_turns(target, compatible, item, chain, images))
        for n, ((prompt, a), (_, s), (_, c)) in enumerate(zip(plain, spec, compat)):
            n_images = prompt.num_images
            turns.append({"id": f"{item.id}/{n}", "category": item.category,
                          "prompt_token_ids": vllm_prompt_ids(prompt.input_ids.tolist(), target.image_token_id),
                          "images": [str(p) for p in item.images[:n_images]],
                          "ar_tokens": a.tokens, "chain_tokens": s.tokens,
                          "accepted": [x.accepted for x in s.cycles],
                          "compatible_accepted": None if c is None else [x.accepted for x in c.cycles]})
    return {"turns": turns, "image_token_id": target.image_token_id,
            "project": {**_chain_figures([t["accepted"] for t in turns], k),
                        "decoding": method,
                        "head": "original" if head is not None else "re-imported export",
                        "export_differs": differs,
                        "chain_equals_ar": sum(t["ar_tokens"] == t["chain_tokens"] for t in turns),
                        "new_tokens": sum(len(t["ar_tokens"]) for t in turns),
                        "tokens_per_s": sum(len(t["chain_tokens"]) for t in turns) / max(t_chain, 1e-9),
                        "ar_tokens_per_s": sum(len(t["ar_tokens"]) for t in turns) / max(t_ar, 1e-9)},
            "project_compatible": None if compatible is None else
            _chain_figures([t["compatible_accepted"] for t in turns], k)}


def compatible_head(head, target):
    """The head as stock vLLM runs the exported folder: no fc bias, no first-layer input
    norm, and at image positions the placeholder token's embedding in place of the visual
    one, with no replacement (``decouple_visual`` off). Its chain figures are what stock
    vLLM should report, as the head's own are what the plugin should."""
    import torch
    from torch import nn

    head.config.decouple_visual = False  # msd3: embeddings() then reads the placeholder's
    if head.feature_layers is None:  # msd: the fc's embedding half too
        placeholder = target.embed_tokens.weight[target.image_token_id]
        own = head.target_inputs

        def target_inputs(features, target=None):
            if features.visual_mask is not None:
                embeds = features.inputs_embeds
                embeds = torch.where(features.visual_mask[..., None].bool(), placeholder.to(embeds.dtype), embeds)
                features = dataclasses.replace(features, inputs_embeds=embeds)
            return own(features, target)

        head.target_inputs = target_inputs
    if getattr(head, "fc", None) is not None and head.fc.bias is not None and head.feature_layers is None:
        nn.init.zeros_(head.fc.bias)
    if head.feature_layers is None and not isinstance(head.layers[0].input_layernorm, nn.Identity):
        head.layers[0].input_layernorm = nn.Identity()
    return head


def _chain_figures(accepted: list[list[int]], k: int) -> dict:
    cycles = [a for turn in accepted for a in turn]
    return {"tau": sum(a + 1 for a in cycles) / max(len(cycles), 1), "cycles": len(cycles),
            "per_position": _per_position(cycles, k)}


def vllm_prompt_ids(ids: list[int], image_token_id: int) -> list[int]:
    """The project's prompt ids as vLLM takes them: one image token per image. The project
    expands each image to its N visual tokens; vLLM expands every image token it is given
    (a prompt with N would get N x N), so each run is folded back to one."""
    out = []
    for i, t in enumerate(ids):
        if not (t == image_token_id and i > 0 and ids[i - 1] == image_token_id):
            out.append(t)
    return out


def _per_position(accepted: list[int], k: int) -> list[float]:
    """Fraction of rounds whose draft token i (0-based) was accepted, as vLLM counts it."""
    n = max(len(accepted), 1)
    return [sum(a > i for a in accepted) / n for i in range(k)]


# ----- the vLLM side (a process per run) -----------------------------------------------

def run_vllm(spec: dict) -> dict:
    """One vLLM engine over ``spec["turns"]`` one prompt at a time (batch 1, as the
    project decodes), greedy; with ``spec["draft"]`` set, speculative with k tokens."""
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    from PIL import Image
    from vllm import LLM, SamplingParams

    speculative = None
    if spec.get("draft"):
        speculative = {"model": spec["draft"], "num_speculative_tokens": spec["k"]}
        if spec.get("method"):
            speculative["method"] = spec["method"]
    llm = LLM(model=spec["target"], enforce_eager=True, max_model_len=spec["max_model_len"], dtype=spec["dtype"],
              speculative_config=speculative, disable_log_stats=False, seed=0,
              limit_mm_per_prompt={"image": spec["max_images"]})
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], ignore_eos=False)
    prompts = []
    for t in spec["turns"]:
        p = {"prompt_token_ids": t["prompt_token_ids"]}
        if t["images"]:
            p["multi_modal_data"] = {"image": [Image.open(i).convert("RGB") for i in t["images"]]}
        prompts.append(p)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up, left out of the figures
    first = before = _spec_counters(llm)
    outputs, per_turn, seconds = [], [], 0.0
    for p in prompts:
        t0 = time.perf_counter()
        outputs.append(list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids))
        seconds += time.perf_counter() - t0
        after = _spec_counters(llm)  # (outside the timed region)
        per_turn.append(_minus(after, before))
        before = after
    counters = _minus(before, first)
    out = {"outputs": outputs, "seconds": seconds, "new_tokens": sum(len(o) for o in outputs),
           "tokens_per_s": sum(len(o) for o in outputs) / max(seconds, 1e-9), "counters": counters,
           "per_turn": per_turn, "draft_class": _draft_class(llm)}
    if speculative and counters["num_drafts"]:
        out["mean_acceptance_length"] = 1 + counters["num_accepted_tokens"] / counters["num_drafts"]
        out["per_position"] = [a / counters["num_drafts"] for a in counters["num_accepted_tokens_per_pos"]]
    return out


def _minus(after: dict, before: dict) -> dict:
    return {k: [a - b for a, b in zip(v, before[k] or [0] * len(v))] if isinstance(v, list) else v - before[k]
            for k, v in after.items()}


def _spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (``vllm:spec_decode_*``), cumulative."""
    names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
             "vllm:spec_decode_num_accepted_tokens_per_pos": "num_accepted_tokens_per_pos"}
    out = {v: 0 for v in names.values()}
    out["num_accepted_tokens_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] = list(m.values) if hasattr(m, "values") else m.value
    return out


def _draft_class(llm) -> str | None:
    """The class name of the engine's draft model (in-process engine only), for the report."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        return type(core.model_executor.driver_worker.worker.model_runner.drafter.model).__name__
    except AttributeError:
        return None


def vllm_process(spec: dict, mode: str, workdir: Path) -> dict:
    """``run_vllm`` in a new process; ``mode`` "stock" loads no plugin of this project."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_file, out_file = workdir / f"{mode}-in.json", workdir / f"{mode}-out.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in CPU_ENV.items()}}
    if mode == "stock":
        from importlib.metadata import entry_points

        others = [e.name for e in entry_points(group="vllm.general_plugins") if not e.value.startswith("msd_train.")]
        env["VLLM_PLUGINS"] = ",".join(others) or "none"
    log = workdir / f"{mode}.log"
    with log.open("w") as f:
        done = subprocess.run([sys.executable, "-m", "msd_train.serving.check", "vllm", str(spec_file), str(out_file)],
                              env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"vLLM ({mode}) exited with {done.returncode}; the end of {log}:\n" + "\n".join(tail))
    return json.loads(out_file.read_text())


def compare(prompts: dict, runs: dict) -> dict:
    """The report: vLLM's figures per run beside the project's, and which outputs agree."""
    turns = prompts["turns"]
    ar = [t["ar_tokens"] for t in turns]
    report = {"turns": len(turns), "project": prompts["project"], "project_compatible": prompts["project_compatible"],
              "vllm": {}}
    plain = runs.get("ar")
    for mode, r in runs.items():
        entry = {k: r.get(k) for k in ("mean_acceptance_length", "per_position", "tokens_per_s", "new_tokens",
                                       "seconds", "counters", "draft_class")}
        entry["outputs_equal_project_ar"] = sum(o == a for o, a in zip(r["outputs"], ar))
        if plain is not None and mode != "ar":
            entry["outputs_equal_vllm_ar"] = sum(o == a for o, a in zip(r["outputs"], plain["outputs"]))
            entry["speedup_over_vllm_ar"] = r["tokens_per_s"] / max(plain["tokens_per_s"], 1e-9)
        if mode != "ar":
            entry["by_category"] = _by_category(turns, r["per_turn"])
        report["vllm"][mode] = entry
    return report


def _by_category(turns: list[dict], per_turn: list[dict]) -> dict:
    """Per benchmark category: vLLM's 1 + accepted / drafts beside the project's chain tau
    and the compatible-mode chain tau over the same turns."""
    out = {}
    for cat in sorted({t["category"] for t in turns}):
        idx = [i for i, t in enumerate(turns) if t["category"] == cat]
        drafts = sum(per_turn[i]["num_drafts"] for i in idx)
        acc = sum(per_turn[i]["num_accepted_tokens"] for i in idx)
        proj = [a for i in idx for a in turns[i]["accepted"]]
        comp = [a for i in idx for a in turns[i]["compatible_accepted"] or []]
        out[cat] = {"turns": len(idx), "vllm_tau": 1 + acc / max(drafts, 1),
                    "project_tau": sum(a + 1 for a in proj) / max(len(proj), 1),
                    "project_compatible_tau": sum(a + 1 for a in comp) / len(comp) if comp else None}
    return out


def summary_lines(report: dict, k: int) -> list[str]:
    p = report["project"]
    n = report["turns"]
    settings = report.get("settings") or {}
    length = (f", bench={settings['bench']}: up to {settings['max_new_tokens']} new tokens a turn"
              if "max_new_tokens" in settings else "")
    method = p.get("decoding", "chain")
    lines = [f"{n} turns, {method} k={k}, greedy{length}",
             f"project {method} ({p.get('head', 're-imported export')})   tau {p['tau']:.3f}  per-position "
             f"{_fmt(p['per_position'])}  outputs = project plain {p['chain_equals_ar']}/{n}",
             *[f"  the export differs from the original head: {d}" for d in p.get("export_differs") or []]]
    if report.get("project_compatible") is not None:
        lines.append(f"project chain, compatible mode (no fc bias, placeholder embeddings)   tau "
                     f"{report['project_compatible']['tau']:.3f}  per-position "
                     f"{_fmt(report['project_compatible']['per_position'])}")
    for mode, r in report["vllm"].items():
        line = f"vLLM {mode:<10} {r['tokens_per_s']:.1f} tok/s  outputs = project plain {r['outputs_equal_project_ar']}/{n}"
        if mode != "ar":
            if r.get("mean_acceptance_length") is not None:
                line += (f"  tau {r['mean_acceptance_length']:.3f}  per-position {_fmt(r['per_position'])}"
                         f"  drafts {r['counters']['num_drafts']}  accepted {r['counters']['num_accepted_tokens']}")
            if "outputs_equal_vllm_ar" in r:
                line += (f"  = vLLM plain {r['outputs_equal_vllm_ar']}/{n}"
                         f"  speedup {r['speedup_over_vllm_ar']:.2f}x")
            line += f"  [{r.get('draft_class')}]"
        lines.append(line)
    return lines


def _fmt(xs) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs or []) + "]"


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "vllm":
    result = run_vllm(json.loads(Path(sys.argv[2]).read_text()))
    Path(sys.argv[3]).write_text(json.dumps(result))
