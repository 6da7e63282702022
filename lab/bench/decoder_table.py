"""GPU benchmark of the MSD speculative decoder on a LLaVA-1.5-7B-shaped target.

    python -m lab.bench.decoder_table --config llava15_7b --device cuda          # on an H100 / H200
    python -m lab.bench.decoder_table --config small --device cpu --repeats 3    # CPU dry run (~1 min)

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
4. bookkeeping per cycle: ``accept`` (greedy) and ``commit`` (as accepted by the random
   head, and for a forced 4-node path, which exercises the KV-cache gather);
5. cycle / step ratio at the default tree and the implied speedup tau * step / cycle
   for tau = 2, 3, 4; the cycle is also timed inside ``decode(method="tree")``;
5b. ensemble drafting: one draft block (default tree, and a chain of 5) with the head alone
   (M) and with the variants M, T, P as three batch rows (IbED), and the overhead.

Training throughput is ``lab/bench/train.py``, which runs the recipe itself.

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

import torch
import transformers

from lab.cli import at_least
from msd_train.targets import target_shapes

ROOT = Path(__file__).resolve().parents[2]

TREE_SIZES = (1, 8, 16, 32, 48, 64, 96)
DEFAULT_TREE = dict(depth=5, top_k=10, total_tokens=60)
TAUS = (2, 3, 4, 4.54)  # 4.54: MSD's measured tau on LLaVA-1.5-7B (MMSpec)
N_IMAGE = 576  # LLaVA-1.5 at 336 px: (336 / 14) ** 2
N_TEXT = 64  # BOS + 63 text tokens
GOALS = {"cycle_over_step_max": 1.5, "project_ar_vs_hf_generate_min": 1.0, "ensemble_draft_overhead_max": 0.30,
         "fraction_of_bandwidth_limit_min": 0.8, "speedup_at_tau_4.54_min": 3.0}

# The published shapes come from the adapters (msd_train/targets, ``target_shapes``); the
# token ids and bench-only settings are added here. llava15_7b is llava-hf/llava-1.5-7b-hf's
# config.json, llava15_13b the same CLIP tower with Llama 40 x 5120.
_SHAPES = target_shapes()
_LLAVA_IDS = dict(image_token_id=32000, projector_hidden_act="gelu")
_LLAMA_EXTRA = dict(rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
_QWEN_EXTRA = dict(eos_token_id=151645, bos_token_id=None, pad_token_id=0)
CONFIGS = {
    "llava15_7b": dict(text=dict(_SHAPES["llava15_7b"]["text"], **_LLAMA_EXTRA), vision=_SHAPES["llava15_7b"]["vision"],
                       **_LLAVA_IDS),
    # A few layers and small widths, same prompt shape (576 visual tokens) and vocabulary:
    # runs end to end on a CPU; its numbers say nothing about a GPU.
    "small": dict(
        text=dict(vocab_size=32064, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, **_LLAMA_EXTRA),
        vision=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    image_size=336, patch_size=14, projection_dim=64, hidden_act="quick_gelu",
                    layer_norm_eps=1e-5),
        **_LLAVA_IDS,
    ),
    "llava15_13b": dict(text=dict(_SHAPES["llava15_13b"]["text"], **_LLAMA_EXTRA),
                        vision=_SHAPES["llava15_13b"]["vision"], **_LLAVA_IDS),
    # Qwen/Qwen2-VL-7B-Instruct: a 672x672 image gives 48x48 patches, merged 2x2 into 576
    # visual tokens (the same prompt shape as LLaVA's).
    "qwen2vl_7b": dict(family="qwen2_vl", image_side=_SHAPES["qwen2vl_7b"]["image_side"],
                       text=dict(_SHAPES["qwen2vl_7b"]["text"], **_QWEN_EXTRA), vision=_SHAPES["qwen2vl_7b"]["vision"],
                       **_QWEN_IDS),
    # small widths of the Qwen2-VL shape, same prompt (576 visual tokens, M-RoPE) and vocabulary: CPU check
    "small_qwen": dict(
        family="qwen2_vl", image_side=672,
        text=dict(vocab_size=152064, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 8, 8]},
                  **_QWEN_EXTRA),
        vision=dict(depth=2, embed_dim=64, hidden_size=256, num_heads=4, mlp_ratio=4, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        **_QWEN_IDS,
    ),
}


# ----- building ---------------------------------------------------------------------------


def build_target(name: str, device: torch.device, dtype: torch.dtype):
    """A random model of ``CONFIGS[name]``, made on ``device`` in ``dtype`` (no fp32 copy of 7B
    weights), wrapped with a stand-in processor: the adapter reads only these attributes of
    it, and timings need no tokenizer."""
    from lab.targets.random import random_config, random_model
    from msd_train.targets import wrap_target

    c = dict(CONFIGS[name])
    text, vision = c.pop("text"), c.pop("vision")
    c.pop("image_side", None)
    family = c.pop("family", "llava")
    if family == "llava":
        c["image_seq_length"] = N_IMAGE
    model = random_model(random_config(family, text, vision, **c), seed=0, device=device, dtype=dtype)
    eos, bos = ("</s>", "<s>") if family == "llava" else ("<|im_end|>", None)
    tok = SimpleNamespace(chat_template="{{ messages }}", eos_token_id=text["eos_token_id"], eos_token=eos,
                          bos_token=bos, decode=lambda ids, **kw: "")
    proc = SimpleNamespace(tokenizer=tok, image_token="<image>" if family == "llava" else "<|image_pad|>",
                           image_processor=None)
    return wrap_target(model, proc, f"random-{name}")


def free_bytes(device: torch.device) -> int:
    """Memory free for the model on ``device``: the GPU's, or the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_room(args, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before anything is built, a full-size shape without a GPU (``--device auto`` found
    none) and any shape whose weights do not fit in the memory free on ``device``."""
    from msd_train.errors import ConfigError

    dry = "for the CPU dry run: --config small --device cpu --repeats 3"
    if device.type != "cuda" and args.device == "auto" and not args.config.startswith("small"):
        raise ConfigError(f"no CUDA device is visible here, and --config {args.config} is a GPU measurement "
                          f"(its weights alone are {model_bytes(args.config, dtype) / 1e9:.0f} GB in "
                          f"{str(dtype).replace('torch.', '')}); run it on a GPU, or {dry}")
    need, free = model_bytes(args.config, dtype), free_bytes(device)
    if need * 1.2 > free:
        raise ConfigError(f"--config {args.config} in {str(dtype).replace('torch.', '')} needs about "
                          f"{need * 1.2 / 1e9:.1f} GB on {device} (weights and activations), and {free / 1e9:.1f} GB "
                          f"is free there; use a larger device, --dtype bf16, or {dry}")


def model_bytes(name: str, dtype: torch.dtype) -> int:
    """What the target of ``CONFIGS[name]`` weighs in ``dtype`` (built on the meta device: no memory)."""
    target = build_target(name, torch.device("meta"), dtype)
    return sum(p.numel() for p in target.model.parameters()) * torch.finfo(dtype).bits // 8


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
    if target.uses_mrope:  # ChatML-like: text, <vision_start>, 576 image pads, <vision_end>, text
        c = CONFIGS[target.name.removeprefix("random-")]
        side, vc = c["image_side"], c["vision"]
        grid = side // vc["patch_size"]
        n_text = N_TEXT - 2
        text = torch.randint(3, 150000, (n_text,), generator=g)
        ids = torch.cat([text[: n_text // 2], torch.tensor([c["vision_start_token_id"]]),
                         torch.full((N_IMAGE,), target.image_token_id), torch.tensor([c["vision_end_token_id"]]),
                         text[n_text // 2:]])
        patch = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
        pixel = {"pixel_values": torch.randn(grid * grid, patch, generator=g),
                 "image_grid_thw": torch.tensor([[1, grid, grid]])}
        return Encoded(ids, torch.zeros_like(ids), pixel, 1)
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
    """Undo what one drafting / verification / commit did to a prefilled state: the caches
    are written by position past their committed lengths, so restoring the lengths (and
    the host-side tokens) restores the state."""

    def __init__(self, state):
        self.state = state
        self.cache_len, self.tokens, self.pending = state.cache_len, list(state.tokens), state.pending_hidden
        self.draft_len = state.drafter.cache.length if state.drafter is not None else None

    def restore(self):
        s = self.state
        s.target_cache.length = self.cache_len
        if s.drafter is not None:
            s.drafter.cache.length = self.draft_len
        s.tokens, s.pending_hidden = list(self.tokens), self.pending


def _prefill(target, prompt, drafter=None, capacity: int = 1024):
    from msd_train.decoding import prefill

    state = prefill(target, drafter, prompt, capacity=capacity)
    state.tokens.append(int(state.next_logits.argmax(-1)))
    return state


# ----- the measurements ---------------------------------------------------------------------


def weight_bytes(target) -> int:
    """Bytes one plain decoding step must read: the language model's weights and the
    lm_head (the input embedding table is gathered one row at a time)."""
    lm = target.language_model
    embed = target.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in lm.parameters() if p is not embed)
    head = target.lm_head.weight
    if head.data_ptr() != embed.data_ptr():
        total += head.numel() * head.element_size()
    return total


def bench_bandwidth(device, args) -> dict:
    """Memory bandwidth from a large device-to-device copy (read + write)."""
    n = (2 << 30) if device.type == "cuda" else (128 << 20)  # bytes per buffer
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    xs = timed(lambda s=src, d=dst: d.copy_(s), device, max(args.repeats, 5), max(args.warmup, 2))
    gbs = 2 * n / statistics.median(xs) / 1e9
    return {"buffer_gib": round(n / 2**30, 3), "copy_ms": ms(xs), "gb_per_s": round(gbs, 1),
            "how": "2 x buffer bytes / median time of dst.copy_(src)"}


def bench_plain(target, prompt, args, device, bandwidth: dict) -> dict:
    """1. Plain decoding ms per new token: the project's loop (graphs auto and eager),
    transformers' generate() with a dynamic and a static cache, and the bandwidth limit."""
    import dataclasses

    from msd_train.decoding import DecodeConfig, decode

    n = args.new_tokens
    base = DecodeConfig(method="ar", max_new_tokens=n, eos_token_ids=())
    loops, tokens, first = {}, {}, {}
    for name, graphs in (("project", "auto"), ("project_eager", False)):
        cfg = dataclasses.replace(base, cuda_graphs=graphs)
        # one prefilled state decoded again and again (lengths restored in between), so that
        # its captured steps are reused: the first run pays the capture, reported apart
        state = _prefill(target, prompt)
        state.tokens.clear()
        snap = Snapshot(state)
        per_token = []
        for i in range(1 + args.warmup + args.repeats):
            sync(device)
            t0 = time.perf_counter()
            gen = decode(target, state, cfg)
            sync(device)
            dt = time.perf_counter() - t0
            snap.restore()
            if i == 0:
                first[name] = dt
            elif i > args.warmup:
                per_token.append(dt / len(gen.tokens))
        loops[name], tokens[name] = per_token, gen.tokens
        del state, snap

    model = target.model
    ids = prompt.input_ids[None].to(device)
    pixel = {k: (v.to(device, target.dtype) if v.is_floating_point() else v.to(device))
             for k, v in prompt.pixel.items()}
    att = torch.ones_like(ids)

    def hf(k, cache):
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        return lambda: model.generate(input_ids=ids, attention_mask=att, max_new_tokens=k, min_new_tokens=k,
                                      do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None,
                                      use_cache=True, **pixel, **extra)

    hf_ms, hf_tokens = {}, {}
    with torch.inference_mode():
        for cache in ("dynamic", "static"):
            if cache not in args.hf_caches:
                hf_ms[cache], hf_tokens[cache] = None, "not run (--hf-caches)"
                continue
            try:
                t_n = timed(hf(n, cache), device, args.repeats, args.warmup)
                t_1 = timed(hf(1, cache), device, args.repeats, args.warmup)
                hf_tokens[cache] = hf(n, cache)()[0, ids.shape[1]:].tolist()
                hf_ms[cache] = round((statistics.median(t_n) - statistics.median(t_1)) / (n - 1) * 1e3, 4)
            except Exception as e:  # noqa: BLE001 - a generate() mode this model does not support is a finding
                hf_ms[cache] = None
                hf_tokens[cache] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    step = statistics.median(loops["project"])
    limit_ms = weight_bytes(target) / (bandwidth["gb_per_s"] * 1e9) * 1e3
    return {
        "new_tokens": n,
        "project_ar_ms_per_token": round(step * 1e3, 4),
        "project_ar_ms_per_token_all": ms(loops["project"]),
        "project_ar_eager_ms_per_token": round(statistics.median(loops["project_eager"]) * 1e3, 4),
        "project_ar_first_run_ms": round(first["project"] * 1e3, 3),
        "project_ar_eager_first_run_ms": round(first["project_eager"] * 1e3, 3),
        "first_run_note": "the first decode of a prompt captures its graphs (CUDA): first_run - n * ms_per_token "
                          "is the capture cost a generation pays once",
        "cuda_graphs": device.type == "cuda",
        "hf_generate_ms_per_token": hf_ms.get("dynamic"),
        "hf_generate_static_ms_per_token": hf_ms.get("static"),
        "weight_gb_per_step": round(weight_bytes(target) / 1e9, 3),
        "bandwidth_limit_ms_per_token": round(limit_ms, 4),
        "fraction_of_bandwidth_limit": round(limit_ms / (step * 1e3), 4),
        "project_over_hf_speed": round(hf_ms["dynamic"] / (step * 1e3), 4) if hf_ms.get("dynamic") else None,
        "outputs_match": tokens["project"] == tokens["project_eager"] and (
            tokens["project"] == hf_tokens["dynamic"] if "dynamic" in args.hf_caches else True),
        "hf_dynamic_note": None if isinstance(hf_tokens["dynamic"], list) else hf_tokens["dynamic"],
        "hf_static_outputs_match": (tokens["project"] == hf_tokens["static"]
                                    if "static" in args.hf_caches else None),
        "hf_static_note": None if isinstance(hf_tokens.get("static"), list) else hf_tokens.get("static"),
        "note": "project: decode(method='ar') wall time / new tokens, prefill excluded (one prefilled state, "
                "lengths restored between runs, the first run apart); "
                "hf: (T(generate N) - T(generate 1)) / (N - 1); limit: weight bytes / measured copy bandwidth",
    }


def bench_cycle(target, draft, prompt, args, device, step_s: float) -> dict:
    """2-5. Verification by tree size, drafting, bookkeeping, cycle/step ratio."""
    from msd_train.decoding import (
        DecodeConfig,
        HeadDrafter,
        SamplingParams,
        accept,
        chain,
        commit,
        draft_chain,
        draft_tree,
        verify,
    )
    from msd_train.evaluation.timing import timed_decode
    greedy = SamplingParams()
    state = _prefill(target, prompt, HeadDrafter(draft))
    state.workspace.graphs.configure("auto", device)  # the components as decode() runs them (warm-up captures)
    snap = Snapshot(state)

    def make_tree(size):
        if size == 1:
            return chain(torch.as_tensor([state.tokens[-1]], device=device))
        t = draft_tree(state.drafter, target, state.pending(), depth=max(DEFAULT_TREE["depth"], 8),
                       top_k=DEFAULT_TREE["top_k"], total_tokens=size, sampling=greedy)
        snap.restore()
        return t

    # 2. verification
    verify_ms = {}
    for size in TREE_SIZES:
        tree = make_tree(size)
        xs = timed(lambda t=tree: verify(target, state, t), device, args.repeats, args.warmup, after=snap.restore)
        verify_ms[str(len(tree))] = ms(xs)

    # 3. drafting: the default tree, and a chain of 5
    d = DEFAULT_TREE
    tree_box = {}

    def draft_once():
        tree_box["tree"] = draft_tree(state.drafter, target, state.pending(), d["depth"], d["top_k"], d["total_tokens"], greedy)

    draft_ms = ms(timed(draft_once, device, args.repeats, args.warmup, after=snap.restore))
    chain_ms = ms(timed(lambda: draft_chain(state.drafter, target, state.pending(), 5, greedy), device, args.repeats,
                        args.warmup, after=snap.restore))
    tree = tree_box["tree"]
    default_verify = ms(timed(lambda: verify(target, state, tree), device, args.repeats, args.warmup,
                              after=snap.restore))

    # 4. bookkeeping: greedy acceptance on the device + its one transfer, and the cache
    # update. A random head rarely gets a draft token accepted, so commit is also timed on
    # a forced path to the deepest node at depth <= 3 (the KV-cache gather a trained head pays).
    logits, hidden = verify(target, state, tree)
    accept_box = {}

    def accept_once():
        accept_box["acc"] = accept(tree, logits, greedy)

    accept_ms = ms(timed(accept_once, device, args.repeats, args.warmup))
    acc = accept_box["acc"]
    depths, parents = tree.depths.tolist(), tree.parents.tolist()
    valid = tree.valid.tolist() if tree.valid is not None else [True] * len(depths)  # padding is never accepted
    node = max((i for i, dd in enumerate(depths) if dd <= 3 and valid[i]), key=lambda i: (depths[i], -i))
    forced = [node]
    while forced[-1] != 0:
        forced.append(parents[forced[-1]])
    forced = forced[::-1]
    # the same accept() over logits that agree with the forced path: after each of its nodes the
    # target's argmax is the next node's token, after its last none of that node's children
    forced_logits = logits.clone()
    path = torch.as_tensor(forced, device=device)
    forced_logits[path[:-1], tree.tokens[path[1:]]] = float("inf")
    forced_logits[forced[-1], tree.tokens[tree.parents == forced[-1]]] = float("-inf")
    forced_acc = accept(tree, forced_logits, greedy)
    assert forced_acc.path == forced, (forced_acc.path, forced)

    def commit_with(a):
        return lambda: commit(state, a, hidden)

    commit_ms = ms(timed(commit_with(acc), device, args.repeats, args.warmup, after=snap.restore))
    commit_forced_ms = ms(timed(commit_with(forced_acc), device, args.repeats, args.warmup, after=snap.restore))
    snap.restore()
    bookkeeping = {"accept_greedy_and_read": accept_ms, "commit_as_accepted": commit_ms,
                   "accepted_path_len": len(acc.path), "commit_forced_path": commit_forced_ms,
                   "forced_path": forced}

    # 5. ratio
    cycle_s = (draft_ms["median"] + default_verify["median"] + accept_ms["median"]
               + commit_forced_ms["median"]) / 1e3
    ratio = cycle_s / step_s

    # the cycle as decode(method="tree") runs it, phases timed by events (random head: ~1 token a cycle)
    cfg = DecodeConfig(method="tree", max_new_tokens=args.new_tokens, eos_token_ids=(), **DEFAULT_TREE)
    in_loop = {"draft": [], "verify": [], "accept": [], "total": []}
    state0 = _prefill(target, prompt, HeadDrafter(draft))
    state0.tokens.clear()
    snap0 = Snapshot(state0)
    for i in range(1 + args.warmup + max(1, args.repeats // 2)):  # the first run captures
        gen = timed_decode(target, state0, cfg)
        snap0.restore()
        if i > args.warmup:
            for c in gen.cycles:
                in_loop["draft"].append(c.t_draft)
                in_loop["verify"].append(c.t_verify)
                in_loop["accept"].append(c.t_accept)
                in_loop["total"].append(c.t_draft + c.t_verify + c.t_accept)
    in_loop = {k: ms(v) for k, v in in_loop.items()}
    ratio_loop = in_loop["total"]["median"] / 1e3 / step_s
    return {
        "verify_ms_by_tree_size": verify_ms,
        "draft_tree_ms": draft_ms, "draft_chain_k5_ms": chain_ms, "default_tree": dict(DEFAULT_TREE, nodes=len(tree)),
        "default_tree_verify_ms": default_verify,
        "bookkeeping_ms": bookkeeping,
        "cycle": {
            "cycle_ms": round(cycle_s * 1e3, 4),
            "cycle_parts": "draft_tree + verify(default tree) + accept_greedy/read + commit(forced path)",
            "step_ms": round(step_s * 1e3, 4), "step_from": "project_ar_ms_per_token",
            "cycle_over_step": round(ratio, 4),
            "speedup_at_tau": {str(t): round(t / ratio, 4) for t in TAUS},
            "in_decode_loop_ms": in_loop,
            "in_decode_loop_cycle_over_step": round(ratio_loop, 4),
            "in_decode_loop_speedup_at_tau": {str(t): round(t / ratio_loop, 4) for t in TAUS},
            "goal_cycle_over_step_max": GOALS["cycle_over_step_max"],
            "goal_met": ratio <= GOALS["cycle_over_step_max"],
            "goal_speedup_at_msd_tau_min": GOALS["speedup_at_tau_4.54_min"],
            "speedup_goal_met": 4.54 / ratio >= GOALS["speedup_at_tau_4.54_min"],
        },
    }


def bench_ensemble(target, draft, prompt, args, device) -> dict:
    """5b. One draft block with M alone and with M, T, P as batch rows (IbED weights)."""
    from msd_train.decoding import DecodeConfig, HeadDrafter
    from msd_train.decoding.ensemble import EnsembleDrafter

    states = {"M": _prefill(target, prompt, HeadDrafter(draft)),
              "ibed-MTP": _prefill(target, prompt, EnsembleDrafter(draft, ("M", "T", "P"), "ibed", 32))}
    blocks = {"tree": DecodeConfig(method="tree", **DEFAULT_TREE), "chain_k5": DecodeConfig(method="chain", k=5)}
    out = {}
    for method, cfg in blocks.items():
        row = {}
        for name, state in states.items():
            snap = Snapshot(state)
            row[name] = ms(timed(lambda c=cfg, s=state: s.drafter.draft_block(target, s.pending(), c), device, args.repeats,
                                 args.warmup, after=snap.restore))
        row["overhead"] = round(row["ibed-MTP"]["median"] / row["M"]["median"] - 1, 4)
        out[method] = row
    out["rows"] = {"M": states["M"].drafter.cache.length, "ibed-MTP (padded)": states["ibed-MTP"].drafter.cache.length}
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


def fmt_ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


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
    hf_static = p["hf_generate_static_ms_per_token"]
    lines += ["## 1. Plain decoding (ms per new token, prefill excluded)", "",
              "| loop | ms/token |", "|---|---|",
              f"| project AR (`decode(method='ar')`, CUDA graphs {'on' if p['cuda_graphs'] else 'off'}) | "
              f"{p['project_ar_ms_per_token']:.3f} |",
              f"| project AR, eager | {p['project_ar_eager_ms_per_token']:.3f} |",
              f"| HF `generate()`, dynamic cache | {fmt_ms(p['hf_generate_ms_per_token'])} |",
              f"| HF `generate()`, static cache | {fmt_ms(hf_static)} |",
              f"| bandwidth limit ({p['weight_gb_per_step']:.2f} GB / {r['bandwidth']['gb_per_s']:.0f} GB/s) | "
              f"{p['bandwidth_limit_ms_per_token']:.3f} |", "",
              f"project loop at {100 * p['fraction_of_bandwidth_limit']:.0f}% of the bandwidth limit "
              f"(goal >= {100 * GOALS['fraction_of_bandwidth_limit_min']:.0f}%); outputs match generate(): "
              f"{p['outputs_match']}" + (f"; static-cache generate(): {p['hf_static_note']}" if p["hf_static_note"]
                                         else ""), "",
              f"first decode of the prompt ({p['new_tokens']} tokens, captures the graphs on CUDA): "
              f"{p['project_ar_first_run_ms']:.1f} ms (eager: {p['project_ar_eager_first_run_ms']:.1f} ms)", ""]
    lines += ["## 2. Verification forward by tree size", "", "| nodes | ms |", "|---|---|"]
    lines += [f"| {k} | {v['median']:.3f} |" for k, v in r["cycle"]["verify_ms_by_tree_size"].items()]
    b = r["cycle"]["bookkeeping_ms"]
    lines += ["", "## 3-4. Drafting and bookkeeping (default tree: depth 5, top_k 10, 60 tokens)", "",
              "| phase | ms |", "|---|---|",
              f"| draft_tree | {r['cycle']['draft_tree_ms']['median']:.3f} |",
              f"| draft_chain (k 5) | {r['cycle']['draft_chain_k5_ms']['median']:.3f} |",
              f"| verify (default tree, {r['cycle']['default_tree']['nodes']} nodes) | "
              f"{r['cycle']['default_tree_verify_ms']['median']:.3f} |",
              f"| accept_greedy + its one host read | {b['accept_greedy_and_read']['median']:.3f} |",
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
    ap.add_argument("--repeats", type=at_least(1), default=20, help="timed repeats per measurement (medians)")
    ap.add_argument("--warmup", type=at_least(0), default=3, help="untimed warm-up runs per measurement")
    ap.add_argument("--new-tokens", type=int, default=64, help="plain decoding: new tokens per run")
    ap.add_argument("--hf-caches", default="dynamic,static",
                    help="generate() caches to time: dynamic, static or both (static may compile the model first)")
    ap.add_argument("--threads", type=at_least(1), default=None, help="CPU threads (default 1 on CPU)")
    ap.add_argument("--note", default=None)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/gpu/<config>-<device>.json); "
                                                "the Markdown goes next to it")
    args = ap.parse_args(argv)
    args.hf_caches = [c for c in args.hf_caches.split(",") if c]
    if set(args.hf_caches) - {"dynamic", "static"}:
        raise SystemExit("--hf-caches takes dynamic, static or dynamic,static")
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2")

    from msd_train.targets import resolve_dtype

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.threads or device.type == "cpu":  # CPU: one thread, as lab/bench/decode.py (steadier on shared machines)
        torch.set_num_threads(args.threads or 1)
    dtype = resolve_dtype(args.dtype, device)
    check_room(args, device, dtype)
    t0 = time.time()
    target = build_target(args.config, device, dtype)
    draft = build_draft(target, device, dtype)
    prompt = build_prompt(target)
    draft_params_m = round(sum(p.numel() for p in draft.parameters()) / 1e6, 2)
    draft_bytes = {"head": round(sum(p.numel() * p.element_size() for p in draft.parameters()) / 1e9, 3),
                   "lm_head": round(target.lm_head.weight.numel() * target.lm_head.weight.element_size() / 1e9, 3)}
    print(f"built {target.name} on {device} ({dtype}) in {time.time() - t0:.1f}s", flush=True)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "gpu" / f"decode-{args.config}-{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tc = target.text_config
    result = {
        "what": f"MSD decoder cycle on a random {args.config}-shaped target",
        "dry_run": device.type != "cuda",
        "dry_run_note": ("CPU dry run: checks the benchmark runs end to end, not a GPU measurement"
                         if device.type != "cuda" else None),
        "config": args.config, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m lab.bench.decoder_table " + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": environment(device),
        "target": {"name": target.name, "layers": tc.num_hidden_layers, "hidden": tc.hidden_size,
                   "intermediate": tc.intermediate_size, "heads": tc.num_attention_heads, "vocab": tc.vocab_size,
                   "vision": {k: getattr(target.config.vision_config, k, None) for k in
                              ("hidden_size", "num_hidden_layers", "image_size", "patch_size")},
                   "attn_implementation": target.model.config._attn_implementation,
                   "params_m": round(sum(p.numel() for p in target.model.parameters()) / 1e6, 2)},
        "draft": {"params_m": draft_params_m, "weights": "random", "bytes_per_step_gb": draft_bytes,
                  "note": "one head step reads the head's own weights (layer + fc) and the target's lm_head; "
                          "with a 152k vocabulary (Qwen2-VL) the lm_head outweighs the layer"},
        "prompt_tokens": int(prompt.input_ids.shape[0]),
        "repeats": args.repeats, "warmup": args.warmup, "hf_caches": args.hf_caches,
        "goals": GOALS, "note": args.note, "complete": False,
    }

    def save(**sections) -> None:
        """The JSON so far: a run stopped part-way (a device call's time limit) keeps what it measured."""
        result.update(sections, seconds=round(time.time() - t0, 1))
        out.write_text(json.dumps(result, indent=2) + "\n")

    bandwidth = bench_bandwidth(device, args)
    plain = bench_plain(target, prompt, args, device, bandwidth)
    save(bandwidth=bandwidth, plain_decoding=plain)
    print(f"1. AR {plain['project_ar_ms_per_token']:.3f} ms/token ({100 * plain['fraction_of_bandwidth_limit']:.0f}% "
          f"of the bandwidth limit), HF generate {fmt_ms(plain['hf_generate_ms_per_token'])} / static "
          f"{fmt_ms(plain['hf_generate_static_ms_per_token'])} ms/token", flush=True)
    cycle = bench_cycle(target, draft, prompt, args, device, plain["project_ar_ms_per_token"] / 1e3)
    save(cycle=cycle)
    print(f"2-5. cycle/step {cycle['cycle']['cycle_over_step']:.3f} (in loop "
          f"{cycle['cycle']['in_decode_loop_cycle_over_step']:.3f})", flush=True)
    ensemble = bench_ensemble(target, draft, prompt, args, device)
    print(f"5b. ensemble drafting overhead: tree {100 * ensemble['tree']['overhead']:+.0f}%, chain "
          f"{100 * ensemble['chain_k5']['overhead']:+.0f}%", flush=True)

    goals = {f"cycle_over_step <= {GOALS['cycle_over_step_max']}": cycle["cycle"]["goal_met"],
             "speedup at tau 4.54 >= 3.0": cycle["cycle"]["speedup_goal_met"],
             "project AR >= 80% of the bandwidth limit":
                 plain["fraction_of_bandwidth_limit"] >= GOALS["fraction_of_bandwidth_limit_min"],
             "project AR >= HF generate()": (plain["project_over_hf_speed"] or 0) >= 1.0,
             "ensemble (3 rows) drafting overhead <= 30%": ensemble["goal_met"]}
    save(ensemble=ensemble, goals_met=goals, complete=True)
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a refused argument or device (no GPU, too little memory): one line, exit 1
