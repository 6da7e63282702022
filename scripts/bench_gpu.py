"""GPU benchmark of the MSD speculative decoder on a LLaVA-1.5-7B-shaped target.

    python scripts/bench_gpu.py --config llava15_7b --device cuda          # on an H100 / H200
    python scripts/bench_gpu.py --config small --device cpu --repeats 3    # CPU dry run (~1 min)

The target is built from a LlavaConfig written below (no download, no tokenizer): the
published shape of ``llava-hf/llava-1.5-7b-hf`` (Llama 32x4096, intermediate 11008,
32 heads, vocabulary 32064; CLIP ViT-L/14 at 336 px, 576 visual tokens) with random
weights, and an MSD head of its real size (``MSDDraftConfig.from_target_config``).
The prompt is BOS + 576 image tokens + 63 text tokens (640 tokens, a 336x336 random image).

Measured (medians over ``--repeats`` after ``--warmup`` runs, device synchronised):

1. plain decoding, ms per new token after the prefill: this project's AR loop
   (``decode(method="ar")``) and transformers' ``generate()`` on the same model
   (its per-token time is (T(N tokens) - T(1 token)) / (N - 1), which removes the prefill);
2. one verification forward over trees of 1, 8, 16, 32, 48, 64, 96 nodes on that context;
3. building the EAGLE-2 draft tree (depth 5, top_k 10, 60 tokens) with the head;
4. bookkeeping per cycle: ``accept_greedy`` and ``commit`` (as accepted by the random
   head, and for a forced 4-node path, which exercises the KV-cache gather);
5. cycle / step ratio at the default tree and the implied speedup tau * step / cycle
   for tau = 2, 3, 4; the cycle is also timed inside ``decode(method="tree")``;
5b. ensemble drafting: one draft block (default tree, and a chain of 5) with the head alone
   (M) and with the variants M, T, P as three batch rows (IbED), and the overhead.

Training throughput is ``scripts/bench_train.py``, which runs the recipe itself.

Writes ``--out`` (JSON) and the same name with ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

TREE_SIZES = (1, 8, 16, 32, 48, 64, 96)
DEFAULT_TREE = dict(depth=5, top_k=10, total_tokens=60)
TAUS = (2, 3, 4)
N_IMAGE = 576  # LLaVA-1.5 at 336 px: (336 / 14) ** 2
N_TEXT = 64  # BOS + 63 text tokens
GOALS = {"cycle_over_step_max": 1.15, "project_ar_vs_hf_generate_min": 1.0, "ensemble_draft_overhead_max": 0.30}

# Hand-written configurations. llava15_7b is llava-hf/llava-1.5-7b-hf's config.json.
CONFIGS = {
    "llava15_7b": dict(
        text=dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu",
                    layer_norm_eps=1e-5),
        image_token_id=32000, projector_hidden_act="gelu",
    ),
    # A few layers and small widths, same prompt shape (576 visual tokens) and vocabulary:
    # runs end to end on a CPU; its numbers say nothing about a GPU.
    "small": dict(
        text=dict(vocab_size=32064, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    image_size=336, patch_size=14, projection_dim=64, hidden_act="quick_gelu",
                    layer_norm_eps=1e-5),
        image_token_id=32000, projector_hidden_act="gelu",
    ),
}


# ----- building ---------------------------------------------------------------------------


def build_target(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from msd_train.targets import wrap_target

    c = CONFIGS[name]
    text = LlamaConfig(**c["text"])
    vision = CLIPVisionConfig(**c["vision"])
    cfg = LlavaConfig(text_config=text, vision_config=vision, image_token_id=c["image_token_id"],
                      projector_hidden_act=c["projector_hidden_act"], vision_feature_layer=-2,
                      vision_feature_select_strategy="default", image_seq_length=N_IMAGE)
    torch.manual_seed(0)
    with torch.device(device):  # initialise in place and in dtype: no fp32 copy of 7B weights
        model = LlavaForConditionalGeneration._from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    # The adapter reads only these attributes of the processor; timings need no tokenizer.
    tok = SimpleNamespace(chat_template="{{ messages }}", eos_token_id=2, eos_token="</s>", bos_token="<s>",
                          decode=lambda ids, **kw: "")
    proc = SimpleNamespace(tokenizer=tok, image_token="<image>", image_processor=None)
    return wrap_target(model, proc, f"random-{name}")


def build_draft(target, device, dtype):
    from msd_train.draft import MSDDraftConfig, MSDDraftModel

    torch.manual_seed(1)
    config = MSDDraftConfig.from_target_config(target.config, target.name)
    with torch.device(device):
        return MSDDraftModel(config).to(device, dtype).eval()


def build_prompt(target, seed: int = 0):
    from msd_train.targets import Encoded

    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    text = torch.randint(3, min(vocab, 32000), (N_TEXT - 1,), generator=g)  # no special ids
    ids = torch.cat([torch.tensor([1]), torch.full((N_IMAGE,), target.image_token_id), text])
    side = target.config.vision_config.image_size
    pixel = {"pixel_values": torch.randn(1, 3, side, side, generator=g)}
    return Encoded(ids, torch.zeros_like(ids), pixel, 1)


# ----- timing -----------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int, warmup: int, before=None, after=None) -> list[float]:
    """Seconds per call of ``fn`` (``before``/``after`` run untimed around each call).

    CUDA events bracket the call on a GPU (after a synchronisation), the wall clock elsewhere.
    """
    out = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        if after is not None:
            after()
        if i >= warmup:
            out.append(dt)
    return out


def ms(xs: list[float]) -> dict:
    """Median and spread in milliseconds."""
    return {"median": round(statistics.median(xs) * 1e3, 4), "min": round(min(xs) * 1e3, 4),
            "max": round(max(xs) * 1e3, 4), "n": len(xs)}


class Snapshot:
    """Undo what one drafting / verification / commit did to a prefilled state, cheaply:
    every cache only grows past the committed prefix, so cropping restores it."""

    def __init__(self, state):
        self.state = state
        self.cache_len, self.draft_len = state.cache_len, state.draft_len
        self.tokens, self.pending = list(state.tokens), state.pending_hidden

    def restore(self):
        from msd_train.draft import crop_cache

        s = self.state
        crop_cache(s.target_cache, self.cache_len)
        if s.draft_cache is not None:
            crop_cache(s.draft_cache, self.draft_len)
        s.cache_len, s.draft_len = self.cache_len, self.draft_len
        s.tokens, s.pending_hidden = list(self.tokens), self.pending


# ----- the measurements ---------------------------------------------------------------------


def bench_plain(target, prompt, args, device) -> dict:
    """1. Plain decoding: the project's AR loop and HF generate(), ms per new token."""
    from msd_train.decoding import DecodeConfig, decode, prefill

    n = args.new_tokens
    state0 = prefill(target, None, prompt)
    cfg = DecodeConfig(method="ar", max_new_tokens=n, eos_token_ids=())
    holder = {}
    per_token, cycle = [], []
    for i in range(args.warmup + args.repeats):
        st = state0.clone()
        sync(device)
        t0 = time.perf_counter()
        gen = decode(target, None, st, cfg)
        sync(device)
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            per_token.append(dt / len(gen.tokens))
            cycle += [c.t_draft + c.t_verify + c.t_accept for c in gen.cycles]
        holder["tokens"] = gen.tokens
    del state0

    model = target.model
    ids = prompt.input_ids[None].to(device)
    pixel = prompt.pixel["pixel_values"].to(device, target.dtype)
    att = torch.ones_like(ids)

    def hf(k):
        return lambda: model.generate(input_ids=ids, pixel_values=pixel, attention_mask=att, max_new_tokens=k,
                                      min_new_tokens=k, do_sample=False, num_beams=1, pad_token_id=0,
                                      eos_token_id=None, use_cache=True)

    with torch.inference_mode():
        t_n = timed(hf(n), device, args.repeats, args.warmup)
        t_1 = timed(hf(1), device, args.repeats, args.warmup)
        hf_tokens = hf(n)()[0, ids.shape[1]:].tolist()
    hf_step = (statistics.median(t_n) - statistics.median(t_1)) / (n - 1)
    proj_step = statistics.median(per_token)
    return {
        "new_tokens": n,
        "project_ar_ms_per_token": round(proj_step * 1e3, 4),
        "project_ar_ms_per_token_all": ms(per_token),
        "project_ar_ms_per_cycle_in_loop": ms(cycle),
        "hf_generate_ms_per_token": round(hf_step * 1e3, 4),
        "hf_generate_ms_total": ms(t_n), "hf_generate_ms_prefill_plus_1": ms(t_1),
        "project_over_hf_speed": round(hf_step / proj_step, 4),  # > 1: the project's loop is faster
        "outputs_match": holder["tokens"] == hf_tokens,
        "note": "project: decode() wall time / new tokens, prefill excluded (state cloned untimed); "
                "hf: (T(generate N) - T(generate 1)) / (N - 1)",
    }


def bench_cycle(target, draft, prompt, args, device, step_s: float) -> dict:
    """2-5. Verification by tree size, drafting, bookkeeping, cycle/step ratio."""
    from msd_train.decoding import DecodeConfig, SamplingParams, decode, prefill
    from msd_train.decoding.speculative import accept_greedy, commit, draft_tree, verify
    from msd_train.decoding.tree import chain

    greedy = SamplingParams()
    state = prefill(target, draft, prompt)
    state.tokens.append(int(state.next_logits.argmax(-1)))
    snap = Snapshot(state)

    def make_tree(size):
        if size == 1:
            return chain(torch.as_tensor([state.tokens[-1]], device=device))
        t = draft_tree(draft, target, state, depth=max(DEFAULT_TREE["depth"], 8), top_k=DEFAULT_TREE["top_k"],
                       total_tokens=size, sampling=greedy)
        snap.restore()
        return t

    # 2. verification
    verify_ms = {}
    for size in TREE_SIZES:
        tree = make_tree(size)
        xs = timed(lambda t=tree: verify(target, state, t), device, args.repeats, args.warmup, after=snap.restore)
        verify_ms[str(len(tree))] = ms(xs)

    # 3. drafting (the default tree)
    d = DEFAULT_TREE
    tree_box = {}

    def draft_once():
        tree_box["tree"] = draft_tree(draft, target, state, d["depth"], d["top_k"], d["total_tokens"], greedy)

    draft_ms = ms(timed(draft_once, device, args.repeats, args.warmup, after=snap.restore))
    tree = tree_box["tree"]
    default_verify = ms(timed(lambda: verify(target, state, tree), device, args.repeats, args.warmup,
                              after=snap.restore))

    # 4. bookkeeping: acceptance and cache update, on the verified default tree. A random head
    # rarely gets a draft token accepted, so commit is also timed on a forced path to the
    # deepest node at depth <= 3 (what a trained head at tau ~ 4 commits: a KV-cache gather).
    logits, hidden = verify(target, state, tree)
    after_verify = (state.cache_len, state.target_cache.get_seq_length())
    accept_box = {}

    def accept_once():
        accept_box["r"] = accept_greedy(tree, logits)

    accept_ms = ms(timed(accept_once, device, args.repeats, args.warmup))
    path, bonus = accept_box["r"]
    depths = tree.depths.tolist()
    node = max((i for i, dd in enumerate(depths) if dd <= 3), key=lambda i: (depths[i], -i))
    forced = [node]
    parents = tree.parents.tolist()
    while forced[-1] != 0:
        forced.append(parents[forced[-1]])
    forced = forced[::-1]

    def regrow():  # put the verified tree's entries back in the target cache
        snap.restore()
        verify(target, state, tree)

    def commit_with(p):
        return lambda: commit(state, tree, p, bonus, hidden)

    commit_ms = ms(timed(commit_with(path), device, args.repeats, args.warmup, before=regrow))
    commit_forced_ms = ms(timed(commit_with(forced), device, args.repeats, args.warmup, before=regrow))
    snap.restore()
    bookkeeping = {"accept_greedy": accept_ms, "commit_as_accepted": commit_ms, "accepted_path_len": len(path),
                   "commit_forced_path": commit_forced_ms, "forced_path": forced,
                   "cache_len_after_verify": after_verify}

    # 5. ratio
    cycle_s = (draft_ms["median"] + default_verify["median"] + accept_ms["median"]
               + commit_forced_ms["median"]) / 1e3
    ratio = cycle_s / step_s

    # the cycle as decode(method="tree") runs it (random head: about one token per cycle)
    cfg = DecodeConfig(method="tree", max_new_tokens=args.new_tokens, eos_token_ids=(), **DEFAULT_TREE)
    in_loop = {"draft": [], "verify": [], "accept": [], "total": []}
    state0 = prefill(target, draft, prompt)
    for i in range(args.warmup + max(1, args.repeats // 2)):
        gen = decode(target, draft, state0.clone(), cfg)
        if i >= args.warmup:
            for c in gen.cycles:
                in_loop["draft"].append(c.t_draft)
                in_loop["verify"].append(c.t_verify)
                in_loop["accept"].append(c.t_accept)
                in_loop["total"].append(c.t_draft + c.t_verify + c.t_accept)
    in_loop = {k: ms(v) for k, v in in_loop.items()}
    ratio_loop = in_loop["total"]["median"] / 1e3 / step_s
    return {
        "verify_ms_by_tree_size": verify_ms,
        "draft_tree_ms": draft_ms, "default_tree": dict(DEFAULT_TREE, nodes=len(tree)),
        "default_tree_verify_ms": default_verify,
        "bookkeeping_ms": bookkeeping,
        "cycle": {
            "cycle_ms": round(cycle_s * 1e3, 4),
            "cycle_parts": "draft_tree + verify(default tree) + accept_greedy + commit(forced path)",
            "step_ms": round(step_s * 1e3, 4), "step_from": "project_ar_ms_per_token",
            "cycle_over_step": round(ratio, 4),
            "speedup_at_tau": {str(t): round(t / ratio, 4) for t in TAUS},
            "in_decode_loop_ms": in_loop,
            "in_decode_loop_cycle_over_step": round(ratio_loop, 4),
            "in_decode_loop_speedup_at_tau": {str(t): round(t / ratio_loop, 4) for t in TAUS},
            "goal_cycle_over_step_max": GOALS["cycle_over_step_max"],
            "goal_met": ratio <= GOALS["cycle_over_step_max"],
        },
    }


def bench_ensemble(target, draft, prompt, args, device) -> dict:
    """5b. One draft block with M alone and with M, T, P as batch rows (IbED weights)."""
    from msd_train.decoding import SamplingParams, prefill
    from msd_train.decoding.ensemble import prefill_ensemble
    from msd_train.decoding.speculative import draft_chain, draft_tree

    greedy, d = SamplingParams(), DEFAULT_TREE
    states = {"M": prefill(target, draft, prompt),
              "ibed-MTP": prefill_ensemble(target, draft, prompt, ("M", "T", "P"), "ibed", 32)}
    for state in states.values():
        state.tokens.append(int(state.next_logits.argmax(-1)))
    blocks = {"tree": lambda s: draft_tree(draft, target, s, d["depth"], d["top_k"], d["total_tokens"], greedy),
              "chain_k5": lambda s: draft_chain(draft, target, s, 5, greedy)}
    out = {}
    for method, block in blocks.items():
        row = {}
        for name, state in states.items():
            snap = Snapshot(state)
            row[name] = ms(timed(lambda b=block, s=state: b(s), device, args.repeats, args.warmup, after=snap.restore))
        row["overhead"] = round(row["ibed-MTP"]["median"] / row["M"]["median"] - 1, 4)
        out[method] = row
    out["rows"] = {"M": states["M"].draft_len, "ibed-MTP (padded)": states["ibed-MTP"].draft_len}
    out["goal_overhead_max"] = GOALS["ensemble_draft_overhead_max"]
    out["goal_met"] = all(out[m]["overhead"] <= GOALS["ensemble_draft_overhead_max"] for m in blocks)
    return out


# ----- report -------------------------------------------------------------------------------


def environment(device) -> dict:
    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}
    try:
        import deepspeed  # noqa: F401

        env["deepspeed"] = deepspeed.__version__
    except ImportError:
        env["deepspeed"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    else:
        env["gpu"] = None
    return env


def markdown(r: dict) -> str:
    p, c = r["plain_decoding"], r["cycle"]["cycle"]
    lines = [f"# MSD decoder benchmark: `{r['config']}` on {r['environment']['gpu'] or 'CPU'}", ""]
    if r["dry_run"]:
        lines += ["**CPU DRY RUN, NOT A GPU MEASUREMENT.** It checks that the benchmark runs end to end; "
                  "the numbers say nothing about H100/H200 speed.", ""]
    e = r["environment"]
    lines += [f"- command: `{r['command']}`", f"- created: {r['created']}",
              f"- dtype {r['dtype']}, torch {e['torch']}, transformers {e['transformers']}, "
              f"deepspeed {e['deepspeed']}, cuda {e.get('cuda')}, python {e['python']}",
              f"- target: {r['target']['params_m']} M parameters ({r['target']['layers']} layers, hidden "
              f"{r['target']['hidden']}), head {r['draft']['params_m']} M; prompt {r['prompt_tokens']} tokens "
              f"({N_IMAGE} visual)", f"- repeats {r['repeats']} after {r['warmup']} warm-up; medians", ""]
    lines += ["## 1. Plain decoding (ms per new token, prefill excluded)", "",
              "| loop | ms/token |", "|---|---|",
              f"| project AR (`decode(method='ar')`) | {p['project_ar_ms_per_token']:.3f} |",
              f"| HF `generate()` | {p['hf_generate_ms_per_token']:.3f} |", "",
              f"project / HF speed: {p['project_over_hf_speed']:.3f} (goal >= 1); outputs match: "
              f"{p['outputs_match']}", ""]
    lines += ["## 2. Verification forward by tree size", "", "| nodes | ms |", "|---|---|"]
    lines += [f"| {k} | {v['median']:.3f} |" for k, v in r["cycle"]["verify_ms_by_tree_size"].items()]
    b = r["cycle"]["bookkeeping_ms"]
    lines += ["", "## 3-4. Drafting and bookkeeping (default tree: depth 5, top_k 10, 60 tokens)", "",
              "| phase | ms |", "|---|---|",
              f"| draft_tree | {r['cycle']['draft_tree_ms']['median']:.3f} |",
              f"| verify (default tree, {r['cycle']['default_tree']['nodes']} nodes) | "
              f"{r['cycle']['default_tree_verify_ms']['median']:.3f} |",
              f"| accept_greedy | {b['accept_greedy']['median']:.3f} |",
              f"| commit, accepted path ({b['accepted_path_len']} node) | {b['commit_as_accepted']['median']:.3f} |",
              f"| commit, forced path {b['forced_path']} | {b['commit_forced_path']['median']:.3f} |", ""]
    lines += ["## 5. Cycle vs. plain step", "",
              f"cycle {c['cycle_ms']:.3f} ms ({c['cycle_parts']}); step {c['step_ms']:.3f} ms; "
              f"**cycle/step = {c['cycle_over_step']:.3f}** (goal <= {c['goal_cycle_over_step_max']}); "
              f"inside decode(): {c['in_decode_loop_cycle_over_step']:.3f}", "",
              "| tau | speedup (components) | speedup (in loop) |", "|---|---|---|"]
    lines += [f"| {t} | {c['speedup_at_tau'][t]:.2f} | {c['in_decode_loop_speedup_at_tau'][t]:.2f} |"
              for t in c["speedup_at_tau"]]
    en = r["ensemble"]
    lines += ["", "## 5b. Ensemble drafting (M alone vs M, T, P as batch rows, IbED)", "",
              "| draft block | M ms | ibed-MTP ms | overhead |", "|---|---|---|---|"]
    lines += [f"| {m} | {en[m]['M']['median']:.3f} | {en[m]['ibed-MTP']['median']:.3f} | {100 * en[m]['overhead']:+.0f}% |"
              for m in ("tree", "chain_k5")]
    lines += ["", f"goal: overhead <= {100 * en['goal_overhead_max']:.0f}%"]
    lines += ["", "## Goals", ""] + [f"- {k}: {'met' if v else 'MISSED'}" for k, v in r["goals_met"].items()]
    if r.get("note"):
        lines += ["", f"Note: {r['note']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="llava15_7b")
    ap.add_argument("--device", default="auto", help="cuda, cuda:N, cpu (auto: cuda when available)")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats per measurement (medians)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed warm-up runs per measurement")
    ap.add_argument("--new-tokens", type=int, default=64, help="plain decoding: new tokens per run")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default 1 on CPU)")
    ap.add_argument("--note", default=None)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/gpu/<config>-<device>.json); "
                                                "the Markdown goes next to it")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2")

    from msd_train.targets import resolve_dtype

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.threads or device.type == "cpu":  # CPU: one thread, as bench_decode (steadier on shared machines)
        torch.set_num_threads(args.threads or 1)
    dtype = resolve_dtype(args.dtype, device)
    t0 = time.time()
    target = build_target(args.config, device, dtype)
    draft = build_draft(target, device, dtype)
    prompt = build_prompt(target)
    draft_params_m = round(sum(p.numel() for p in draft.parameters()) / 1e6, 2)
    print(f"built {target.name} on {device} ({dtype}) in {time.time() - t0:.1f}s", flush=True)

    plain = bench_plain(target, prompt, args, device)
    print(f"1. AR {plain['project_ar_ms_per_token']:.3f} ms/token, HF generate "
          f"{plain['hf_generate_ms_per_token']:.3f} ms/token", flush=True)
    cycle = bench_cycle(target, draft, prompt, args, device, plain["project_ar_ms_per_token"] / 1e3)
    print(f"2-5. cycle/step {cycle['cycle']['cycle_over_step']:.3f} (in loop "
          f"{cycle['cycle']['in_decode_loop_cycle_over_step']:.3f})", flush=True)
    ensemble = bench_ensemble(target, draft, prompt, args, device)
    print(f"5b. ensemble drafting overhead: tree {100 * ensemble['tree']['overhead']:+.0f}%, chain "
          f"{100 * ensemble['chain_k5']['overhead']:+.0f}%", flush=True)

    tc = target.text_config
    goals = {"cycle_over_step <= 1.15": cycle["cycle"]["goal_met"],
             "project AR >= HF generate()": plain["project_over_hf_speed"] >= 1.0,
             "ensemble (3 rows) drafting overhead <= 30%": ensemble["goal_met"]}
    result = {
        "what": "MSD decoder cycle on a random LLaVA-1.5-7B-shaped target",
        "dry_run": device.type != "cuda",
        "dry_run_note": ("CPU dry run: checks the benchmark runs end to end, not a GPU measurement"
                         if device.type != "cuda" else None),
        "config": args.config, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": environment(device),
        "target": {"name": target.name, "layers": tc.num_hidden_layers, "hidden": tc.hidden_size,
                   "intermediate": tc.intermediate_size, "heads": tc.num_attention_heads, "vocab": tc.vocab_size,
                   "vision": {k: getattr(target.config.vision_config, k) for k in
                              ("hidden_size", "num_hidden_layers", "image_size", "patch_size")},
                   "attn_implementation": target.model.config._attn_implementation,
                   "params_m": round(sum(p.numel() for p in target.model.parameters()) / 1e6, 2)},
        "draft": {"params_m": draft_params_m, "weights": "random"},
        "prompt_tokens": int(prompt.input_ids.shape[0]),
        "repeats": args.repeats, "warmup": args.warmup,
        "plain_decoding": plain, "cycle": cycle, "ensemble": ensemble,
        "goals": GOALS, "goals_met": goals,
        "seconds": round(time.time() - t0, 1), "note": args.note,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "gpu" / f"{args.config}-{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
