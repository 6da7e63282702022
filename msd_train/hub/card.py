"""The model card (README.md) of a pushed head: how it was trained, what it measured.

Everything in the card is read from files the project writes: the head's config.json,
`training.json` of its export folder (and of the stage it started from), the LoRA
adapter's `adapter_config.json`, and the evaluation's `report.json`. Nothing is typed
in by hand, so the card cannot drift from the head; the one exception is `base_model`,
the target's Hub id, for heads trained on a local copy of it.

A card travels: it never prints a local absolute path (those name folders on the
machine that trained the head, and leak its layout); they appear as `<local>/NAME`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from msd_train.draft import MSDDraftConfig
from msd_train.draft.head import HEADS, DraftHead, head_class_of_config
from msd_train.formatting import fmt
from msd_train.paths import is_repo_id
from msd_train.targets import head_family
from msd_train.targets.lora import adapter_identity

log = logging.getLogger(__name__)

TAGS = ["speculative-decoding", "msd", "eagle", "draft-model", "multimodal"]

#: File names of the MSD recipe's data -> their Hugging Face dataset repositories.
KNOWN_DATASETS = {
    "ShareGPT_V3_unfiltered_cleaned_split.json": "anon8231489123/ShareGPT_Vicuna_unfiltered",
    "llava_v1_5_mix665k.json": "liuhaotian/LLaVA-Instruct-150K",
}

#: An absolute (or home-relative) local path inside running text; not a URL's "//host/..."
#: nor "a/b" within a word.
_LOCAL_PATH = re.compile(r"(?<![\w:/.~-])~?/[^\s`'\"()\[\]{}<>,;|*]+")


def hub_id(name: str | None) -> str | None:
    """`name` if it reads as a Hub repo id (OWNER/NAME) and is not a local folder, else None."""
    if not name or not is_repo_id(name) or Path(str(name)).exists():
        return None
    return str(name)


def public(text: str) -> str:
    """`text` with every local absolute path shortened to `<local>/its-last-part`."""
    def short(m: re.Match) -> str:
        name = m.group(0).rstrip("/").rsplit("/", 1)[-1]
        return f"<local>/{name}" if name and name != "~" else "<local>"

    return _LOCAL_PATH.sub(short, text)


def local_name(name: str | None) -> str | None:
    """The last part of a local path (what a user would recognise), or None."""
    return Path(str(name).rstrip("/")).name or None if name else None

# --- gathering ---------------------------------------------------------------------------------


def read_training(folder: Path) -> list[dict]:
    """`training.json` of this export and of the stages before it, oldest first.

    A stage-2 export starts from `stage.init_from` or, when that is null,
    `RUN_DIR/stage1/final` (the trainer's rule); its training.json is read from there.
    """
    chain, seen = [], set()
    path = folder / "training.json"
    while path.is_file() and path.resolve() not in seen:
        seen.add(path.resolve())
        meta = json.loads(path.read_text())
        chain.append(meta)
        cfg = meta.get("config") or {}
        stage = cfg.get("stage") or {}
        if str(meta.get("stage", stage.get("id"))) in ("1", "None"):
            break
        init = stage.get("init_from") or (f"{cfg['run_dir']}/stage1/final" if cfg.get("run_dir") else None)
        if not init:
            break
        path = Path(init) / "training.json"
    return chain[::-1]


def find_report(folder: Path, explicit: str | Path | None = None) -> Path | None:
    """`explicit` if given; else the newest report.json in the export folder, a folder
    inside it, its parent, or a folder beside it. A report whose `draft` names another
    head is skipped."""
    if explicit:
        path = Path(explicit)
        if path.is_dir():
            path = path / "report.json"
        if not path.is_file():
            raise FileNotFoundError(f"report={explicit}: no such report.json")
        return path
    here = folder.resolve()
    candidates = [here / "report.json", *here.glob("*/report.json"), here.parent / "report.json",
                  *here.parent.glob("*/report.json")]
    found = []
    for path in {p.resolve() for p in candidates if p.is_file()}:
        try:
            data = json.loads(path.read_text())
            draft = data.get("draft_folder") or data.get("draft")  # eval.py records the head's absolute folder
        except (json.JSONDecodeError, AttributeError):
            continue
        if draft and Path(str(draft)).exists() and Path(str(draft)).resolve() != here:
            continue
        found.append(path)
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def datasets_of(training: list[dict]) -> list[str]:
    """Hub dataset ids behind the training data: known file names, or paths that are ids."""
    out = []
    for meta in training:
        data = (meta.get("config") or {}).get("data") or {}
        for key in ("text", "multimodal"):
            for source in data.get(key) or []:
                path = str(source.get("path", "")) if isinstance(source, dict) else str(source)
                ident = KNOWN_DATASETS.get(Path(path).name)
                if ident is None:
                    ident = hub_id(path)
                if ident and ident not in out:
                    out.append(ident)
    return out


# --- rendering ---------------------------------------------------------------------------------




METRICS = [
    ("tau", "tau", 3),
    ("speedup", "speedup", 2),
    ("tokens_per_s", "tokens/s", 1),
    ("ar_tokens_per_s", "AR tokens/s", 1),
    ("outputs_match_ar", "matches AR", 3),
    ("n_samples", "samples", 0),
    ("new_tokens", "new tokens", 0),
]


def _metrics_row(name: str, m: dict) -> str:
    return "| " + " | ".join([name] + [fmt(m.get(k), d) for k, _, d in METRICS]) + " |"


def _groups(report: dict) -> dict[str, dict]:
    """Per-category (per-benchmark) metrics, whichever key the report uses."""
    for key in ("per_category", "categories", "per_benchmark", "benchmarks", "by_category"):
        groups = report.get(key)
        if isinstance(groups, dict):
            return {str(k): v for k, v in groups.items() if isinstance(v, dict)}
        if isinstance(groups, list):
            return {str(g.get("category") or g.get("name") or g.get("bench") or i): g
                    for i, g in enumerate(groups) if isinstance(g, dict)}
    return {}


def _evaluation_section(report: dict | None, report_name: str | None, repo_id: str, target: str) -> list[str]:
    lines = ["## Evaluation", ""]
    if report is None:
        lines += [
            "No evaluation was recorded for this head. Measure it with",
            "",
            "```bash",
            f"python eval.py draft={repo_id} out=eval/{repo_id.split('/')[-1]} "
            f"target.name_or_path={target}",
            "```",
            "",
        ]
        return lines
    overall = report.get("overall") if isinstance(report.get("overall"), dict) else report
    command = report.get("command")
    lines += [f"Numbers from `{report_name}` (uploaded with the head)."]
    if command:
        lines += ["", "Evaluated with", "", "```bash", str(command), "```"]
    settings = report.get("decoding") or report.get("settings")
    facts = []
    if report.get("device") or overall.get("device"):
        facts.append(f"- device: {report.get('device') or overall.get('device')}")
    if isinstance(settings, dict):
        facts.append("- decoding: " + ", ".join(f"{k}={fmt(v)}" for k, v in settings.items()))
    elif settings:
        facts.append(f"- decoding: {settings}")
    for key in ("bench", "benchmark", "dtype", "date"):
        if report.get(key) is not None:
            facts.append(f"- {key}: {fmt(report[key])}")
    if facts:
        lines += [""] + facts
    header = "| | " + " | ".join(label for _, label, _ in METRICS) + " |"
    lines += ["", header, "|" + "---|" * (len(METRICS) + 1), _metrics_row("overall", overall)]
    for name, m in _groups(report).items():
        lines.append(_metrics_row(name, m))
    accept = [(n, m.get("accept_at_pos"), m.get("accept_trials"))
              for n, m in [("overall", overall), *_groups(report).items()]]
    accept = [(n, a, t) for n, a, t in accept if a]
    if accept:
        with_trials = any(t for _, _, t in accept)
        lines += ["", "Acceptance per draft position (conditional: position i accepted given positions < i were"
                  + ("; in brackets the cycles that tried the position" if with_trials else "") + "):", ""]
        lines += [f"- {n}: " + (", ".join(f"{fmt(p, 2)} ({k})" for p, k in zip(a, t)) if t else fmt(a))
                  for n, a, t in accept]
    lines += [
        "",
        "tau: tokens committed per target verification forward, the bonus token included (plain decoding: 1). "
        "speedup: speculative over plain autoregressive tokens/s of the same target in the same process "
        "(ratio of totals). matches AR: whether greedy outputs equal plain greedy decoding exactly.",
        "",
    ]
    return lines


def _training_section(training: list[dict]) -> list[str]:
    lines = ["## Training", ""]
    if not training:
        return lines + ["No training record (`training.json`) came with this head.", ""]
    for meta in training:
        cfg = meta.get("config") or {}
        stage = cfg.get("stage") or {}
        train = cfg.get("train") or {}
        data = cfg.get("data") or {}
        lines += [f"### Stage {meta.get('stage', stage.get('id', '?'))} (exported at step {meta.get('step', '?')})", ""]
        if meta.get("command"):
            lines += ["```bash", str(meta["command"]), "```", ""]
        cur = stage.get("curriculum")
        if cur:
            if not cur.get("ramp_steps") and cur.get("start") == cur.get("end"):
                share = cur.get("start", 0.0)
                text = "text-only" if not share else f"constant multimodal share {share}"
                lines.append(f"- curriculum: {text}")
            else:
                lines.append(f"- curriculum: multimodal share of each batch {cur.get('start')} -> {cur.get('end')} "
                             f"over {cur.get('ramp_steps')} optimizer steps ({cur.get('schedule', 'linear')})")
        for key, label in (("text", "text data"), ("multimodal", "multimodal data")):
            paths = [str(s.get("path")) if isinstance(s, dict) else str(s) for s in data.get(key) or []]
            if paths and (key == "text" or (cur or {}).get("end")):
                lines.append(f"- {label}: " + ", ".join(f"`{Path(p).name}`" for p in paths))
        hp = [f"{k}={train[k]}" for k in ("max_steps", "micro_batch_size", "grad_accum", "lr", "warmup_steps",
                                          "grad_clip", "w_feat", "w_tok", "noise", "noise_scale", "precision")
              if k in train]
        if hp:
            lines.append("- " + ", ".join(hp))
        head = cfg.get("draft") or {}
        head_cls = HEADS.get(head.get("architecture"))
        line = head_cls.card_training(head) if head_cls is not None else None
        if line:
            lines.append(line)
        if cfg.get("deepspeed", {}).get("zero_optimization"):
            lines.append(f"- DeepSpeed ZeRO stage {cfg['deepspeed']['zero_optimization'].get('stage')}")
        lines.append("")
    return lines


def _target_lines(config: MSDDraftConfig, target_id: str | None, head: str = "MSD draft head"
                  ) -> tuple[str, list[str], str]:
    """(title, lines of the Target section, the `load_target` argument of the snippet);
    ``head``: what the title calls the head (``HeadCard.name``)."""
    recorded = config.target_name_or_path
    shape = (f"a {head_family(config).display_name}-family model with hidden size "
             f"{config.hidden_size}" + (f" and a vocabulary of {config.target_vocab_size} tokens"
                                        if config.target_vocab_size else ""))
    if target_id:
        lines = [f"- base model: [`{target_id}`](https://huggingface.co/{target_id})"]
        if recorded and hub_id(recorded) is None:
            lines.append(f"- trained on a local copy of it (a folder named `{local_name(recorded)}`)")
        elif recorded and recorded != target_id:
            lines.append(f"- the head's config records `{recorded}` as its target")
        return f"{head} for {target_id}", lines, target_id
    if recorded:
        name = local_name(recorded)
        return (f"{head} for a local target (`{name}`)",
                [f"- base model: not on the Hub. This head was trained on a local model folder named `{name}`, "
                 f"{shape}. Load that same model as the target (pass the path of your copy to `load_target`): "
                 "the head drafts from its features and its embedding, and `load_head` refuses a target of another "
                 "hidden size. (If that folder is a copy of a Hub model, the head's publisher can name it with "
                 "`base_model=OWNER/NAME` when pushing.)"],
                f"path/to/{name}")
    return (f"{head} (target not recorded)",
            [f"- base model: not recorded with this head. It was trained for {shape}; pass that model to "
             "`load_target`."],
            "path/or/hub-id/of/the-target")


def _serving_section(config: MSDDraftConfig, repo_id: str, target_id: str | None, load_arg: str) -> list[str]:
    """"Serve with vLLM": a snippet that runs as written in vLLM's environment (msd-train's
    scripts/vllm_env.sh; tests/serving/test_vllm_export.py runs it), or, for a head the vLLM export
    refuses (``hub.vllm.vllm_refusals``), why not and what serves it."""
    from msd_train.hub.vllm import vllm_layout, vllm_refusals

    lines = ["## Serve with vLLM", ""]
    refused = vllm_refusals(config)
    if refused:
        return lines + [
            "vLLM cannot serve this head as it was trained, so msd-train's vLLM export (`format=vllm`) refuses it: "
            + "; ".join(refused) + ". Serve it with msd-train's own decoder (Use above; `eval.py` measures it).", ""]
    layout = vllm_layout(config)
    lines += ["```python", "from msd_train.hub.vllm import export_vllm", "from vllm import LLM, SamplingParams"]
    if target_id:
        model = json.dumps(target_id)
    else:
        lines.append("from msd_train.serving.target import vllm_target")
        model = "str(target)"
    lines += ["", f"export_vllm({json.dumps(repo_id)}, \"head-vllm\")   # the folder vLLM serves (it logs what stock "
              "vLLM would lose)"]
    if not target_id:
        lines += [
            "# the target is a local folder (see Target below). A LLaVA folder saved by transformers 5 names its",
            "# vision tower in a way vLLM 0.32 cannot load: vllm_target writes a renamed copy under vllm-target/",
            "# (any other folder comes back as it is)",
            f"target = vllm_target({json.dumps(load_arg)}, \"vllm-target\")",
        ]
    k = layout.speculative_tokens(config) or 5
    lines += [
        f"llm = LLM(model={model}, speculative_config={{\"model\": \"head-vllm\", \"method\": \"{layout.method}\", "
        f"\"num_speculative_tokens\": {k}}})",
        "print(llm.generate([\"Say hello.\"], SamplingParams(max_tokens=32))[0].outputs[0].text)",
        "```",
        "",
        "Run it in vLLM's environment with msd-train installed (msd-train's `bash scripts/vllm_env.sh` builds one; "
        f"`python scripts/export.py checkpoint={repo_id} format=vllm out=head-vllm` writes the same folder). There "
        f"msd-train's plugin serves the head as trained ({layout.plugin_keeps}); {layout.stock}. See "
        "msd-train's docs/serving.md.",
        "",
    ]
    return lines


def _head_class(config) -> type[DraftHead]:
    cls = head_class_of_config(config.model_type)
    if cls is None:
        raise ValueError(f"no head architecture has a config of model_type {config.model_type!r}; "
                         f"known: {sorted(HEADS)}")
    return cls


def model_card(
    config: MSDDraftConfig,
    repo_id: str,
    training: list[dict],
    report: dict | None = None,
    report_name: str | None = "report.json",
    files: list[tuple[str, int]] | None = None,
    license: str = "apache-2.0",
    datasets: list[str] | None = None,
    num_parameters: int | None = None,
    dtype: str | None = None,
    imported_from: str | None = None,
    base_model: str | None = None,
) -> str:
    """README.md text: YAML metadata, then usage, head, target, training, evaluation.

    `base_model`: the target's Hub id, for the metadata, title and usage snippet; default:
    the head's `target_name_or_path` when that is a Hub id. Without one the card says
    plainly which target the user must pass. No local absolute path is printed.
    """
    from huggingface_hub import ModelCardData

    if base_model is not None and hub_id(base_model) is None:
        raise ValueError(f"base_model={base_model}: give the target's Hub model id (OWNER/NAME), not a local path")
    target_id = base_model or hub_id(config.target_name_or_path)
    head = _head_class(config).card(config, num_parameters, dtype)  # the head's own section
    title, target_lines, load_arg = _target_lines(config, target_id, head.name)
    tags = TAGS + list(head.tags) + list(head_family(config).hub_tags)
    data = ModelCardData(
        base_model=target_id,
        license=license,
        datasets=datasets if datasets is not None else (datasets_of(training) or None),
        tags=tags,
        pipeline_tag=None,
    )
    adapter = adapter_identity(config.target_adapter)
    adapter_arg = None
    if config.target_adapter:
        adapter_arg = hub_id(config.target_adapter) or f"path/to/{local_name(config.target_adapter)}"
    lines = [f"# {title}", "", head.summary]
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from msd_train.hub import load_head",
        "from msd_train.targets import load_target",
        "",
    ]
    if not target_id:
        lines.append("# the target is not on the Hub: see Target below for the model to pass")
    lines += [
        f"target = load_target({load_arg!r}" + (f", adapter={adapter_arg!r}" if adapter_arg else "")
        + ", device=\"cuda\")",
        f"head = load_head({repo_id!r}, target=target)",
        *head.usage,
    ]
    lines += ["```", ""] + _serving_section(config, repo_id, target_id, load_arg)
    lines += [
        "## Head",
        "",
        "| field | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {fmt(v)} |" for k, v in head.rows if v is not None]
    if imported_from:
        lines += ["", f"Imported from the released head `{imported_from}` (weights unchanged)."]
    lines += ["", "## Target", ""] + target_lines
    if config.target_vocab_size:
        lines.append(f"- vocabulary: {config.target_vocab_size} tokens")
    if adapter:
        lines.append(f"- LoRA adapter merged into the target: `{adapter['adapter']}`")
        lines += [f"  - {k}: {fmt(v)}" for k, v in adapter.items() if k != "adapter"]
        lines.append("  - load the target with this adapter (`target.adapter=...`): the head was trained on its features")
    else:
        lines.append("- adapter: none")
    lines.append("")
    lines += _training_section(training)
    lines += _evaluation_section(report, report_name, repo_id, load_arg)
    if files:
        lines += ["## Files", ""] + [f"- `{name}` ({size:,} bytes)" for name, size in files] + [""]
    return "\n".join(["---", data.to_yaml(), "---", "", public("\n".join(lines))])
