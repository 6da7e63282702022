"""Config bounds, torch-free and below everything that reads a config: the primitives
(``number``, ``choice``, ``boolean`` over a plain or Omega config, by dotted key) and the
bounds of the decoder's settings (``check_decoding``, ``check_sampling``), which
``DecodeConfig`` and ``SamplingParams`` run on construction and ``eval.py`` runs up front
(through ``msd_train.validate``) before any model loads.

Light on purpose (no torch, no omegaconf at import), and importing only ``errors``: the
decoder imports it, so it must not draw in the hub or the training stack.
"""

from __future__ import annotations

import math
import os
from typing import Any

from msd_train.errors import ConfigError
from msd_train.formatting import with_article

_MISSING = object()


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        if isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif hasattr(node, "get") and part in node:
            node = node[part]
        else:
            return _MISSING
    return node


def _number(cfg, key: str, kind: type, lo=None, hi=None, lo_open=False, allow_none=False, hint: str = ""):
    v = _get(cfg, key)
    if v is _MISSING or (v is None and allow_none):
        return
    ok_type = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind is int:
        ok_type = ok_type and float(v).is_integer()
    if not ok_type:
        raise ConfigError(f"{key}={v!r} is not {'an integer' if kind is int else 'a number'}; "
                          f"give {key}=<{'integer' if kind is int else 'number'}>{hint}")
    if not math.isfinite(v):  # nan passes every comparison below
        raise ConfigError(f"{key}={v} is not a finite number; give {key}=<number>{hint}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        bound = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise ConfigError(f"{key}={v} must be {bound}{hint}")
    if hi is not None and v > hi:
        raise ConfigError(f"{key}={v} must be at most {hi}{hint}")


def _choice(cfg, key: str, choices: tuple, allow_none=False):
    v = _get(cfg, key)
    if v is _MISSING or (v is None and allow_none):
        return
    if v not in choices:
        raise ConfigError(f"{key}={v!r} is not one of {', '.join(map(str, choices))}")


def _bool(cfg, key: str):
    v = _get(cfg, key)
    if v is not _MISSING and not isinstance(v, bool):
        raise ConfigError(f"{key}={v!r}: use true or false")


#: The decoding settings' choices, stated here (torch-free) and read by msd_train/decoding.
METHODS = ("tree", "chain", "block", "ar")
RANK_BY = ("warped", "raw")  # what a sampling draft tree ranks its nodes by
ENSEMBLES = ("ibed", "tabed")
VARIANTS = ("M", "T", "P", "C")
CUDA_GRAPHS = ("auto", True, False, "true", "false", "on", "off")


def check_sampling(sampling) -> None:
    """``decoding.sampling.*``: the warpers (checked by ``SamplingParams`` too)."""
    cfg = {"decoding": {"sampling": sampling}}
    _number(cfg, "decoding.sampling.temperature", float, lo=0, hint=" (0: greedy)")
    _number(cfg, "decoding.sampling.top_p", float, lo=0, lo_open=True, hi=1, hint=" (1: off)")
    _number(cfg, "decoding.sampling.top_k", int, lo=0, hint=" (0: off)")
    _choice(cfg, "decoding.sampling.rank_by", RANK_BY)


def check_decoding(decoding, vocab_size: int | None = None) -> None:
    """``decoding.*`` against the bounds the decoders need: the one place they are checked
    (``eval.py`` up front; ``DecodeConfig`` and ``SamplingParams`` on construction).
    ``vocab_size``: the target's, when known, bounds the tree's ``top_k``."""
    cfg = {"decoding": decoding}
    _choice(cfg, "decoding.method", METHODS)
    for key in ("decoding.max_new_tokens", "decoding.top_k", "decoding.k"):
        _number(cfg, key, int, lo=1)
    _number(cfg, "decoding.depth", int, lo=0, hint=" (0: the root's top_k children only)")
    # A tree is its root (the newest committed token) plus the drafted nodes verified with
    # it (drafter.draft_tree keeps total_tokens - 1 of them): fewer than 2 drafts nothing.
    _number(cfg, "decoding.total_tokens", int, lo=2, hint=" (the root plus at least one drafted token)")
    top_k = _get(cfg, "decoding.top_k")
    if vocab_size and isinstance(top_k, int) and top_k > vocab_size:
        raise ConfigError(f"decoding.top_k={top_k} is more than the target's {vocab_size} tokens (each tree node "
                          f"gets top_k children); give decoding.top_k of at most {vocab_size}, e.g. 10")
    _number(cfg, "decoding.draft_min_prob", float, lo=0, hi=1,
            hint=" (chain: stop drafting below this chain probability under the head; 0: always k tokens)")
    min_prob, method = _get(cfg, "decoding.draft_min_prob"), _get(cfg, "decoding.method")
    if isinstance(min_prob, (int, float)) and min_prob > 0 and method not in (_MISSING, "chain"):
        raise ConfigError(f"decoding.draft_min_prob={min_prob} stops chains; decoding.method={method} does not "
                          f"draft one (use decoding=chain, or leave draft_min_prob at 0)")
    _number(cfg, "decoding.draft_vocab", int, lo=1, hi=vocab_size or None, allow_none=True,
            hint=" (the target tokens an msd head drafts over, e.g. 8192; null: all of them)")
    sampling = _get(cfg, "decoding.sampling")
    if sampling is not _MISSING and sampling is not None:
        check_sampling(sampling)
    _choice(cfg, "decoding.ensemble", ENSEMBLES, allow_none=True)
    variants = _get(cfg, "decoding.variants")
    if variants is not _MISSING and variants is not None:
        variants = [variants] if isinstance(variants, str) else list(variants)
        if not variants or any(v not in VARIANTS for v in variants) or len(set(variants)) != len(variants):
            raise ConfigError(f"decoding.variants={variants}: give distinct entries of {', '.join(VARIANTS)}, "
                              "e.g. decoding.variants=[M,T]")
    window = _get(cfg, "decoding.tabed_window")
    if window is not _MISSING and window != "all":
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"decoding.tabed_window={window!r}: give an integer of at least 1 (the most recent "
                              "verified positions) or all (the whole verified history)")
    rows = _get(cfg, "decoding.plain_rows")
    if rows is not _MISSING and rows not in ("auto", 1, 2):
        raise ConfigError(f"decoding.plain_rows={rows!r}: use auto, 1 or 2 (the plain step's target forward rows; "
                          "auto: 2 for bf16/fp16 targets on a CPU, where it rounds as verification does)")
    graphs = _get(cfg, "decoding.cuda_graphs")
    if graphs is not _MISSING and graphs not in CUDA_GRAPHS:
        raise ConfigError(f"decoding.cuda_graphs={graphs!r}: use auto, true or false")


def method_refusal(architecture: str, methods: tuple[str, ...], method: str, ensemble: str | None) -> str | None:
    """Why a head of ``architecture`` whose drafter honours ``methods`` cannot decode with
    ``decoding.method=method`` (and ``decoding.ensemble``), naming the fix; None: it can.
    ``validate.check_head`` asks it of a saved config before anything loads,
    ``decoding.build.check_method`` of a loaded head."""
    if method == "ar":
        return None
    if method not in methods:
        if method == "block":
            return (f"decoding=block drafts a block in one forward, which only a block head (head=dflash) does; "
                    f"{with_article(architecture)} head drafts step by step: use decoding=tree or decoding=chain")
        return (f"decoding.method={method}: {with_article(architecture)} head proposes a whole block in one forward and cannot "
                f"draft a {method} shape; use decoding=block (decoding.k bounds the proposals verified per cycle)")
    if method == "block" and ensemble is not None:
        return (f"decoding.ensemble={ensemble}: ensembles draft with stepped heads over input variants; "
                f"{with_article(architecture)} head drafts one block: drop decoding.ensemble")
    return None


# ----------------------------------------------------------------------------- the CPU kernels eval.py uses
#: oneDNN's instruction-set levels (ONEDNN_MAX_CPU_ISA), lowest first; bf16 dot products from AVX512_CORE_BF16
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
               "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL", "DEFAULT")


def onednn_max_isa(env: dict | None = None) -> str:
    """``ONEDNN_MAX_CPU_ISA`` as oneDNN reads it (upper case; unset: ALL); a value oneDNN does not
    know is refused with the ones it does (oneDNN itself would ignore it without a word)."""
    env = os.environ if env is None else env
    isa = str(env.get("ONEDNN_MAX_CPU_ISA", "ALL")).strip().upper() or "ALL"
    if isa not in ONEDNN_ISAS:
        raise ConfigError(f"ONEDNN_MAX_CPU_ISA={env.get('ONEDNN_MAX_CPU_ISA')}: oneDNN knows no such instruction set "
                          f"and would run without a limit; set one of {', '.join(ONEDNN_ISAS)}, or unset it")
    return isa


#: what target.cpu_linear takes
CPU_LINEARS = ("auto", "onednn", "aten")


def check_cpu_linear(value) -> str:
    """``target.cpu_linear`` (null: auto), or a ConfigError naming the values it takes."""
    linear = str(value or "auto")
    if linear not in CPU_LINEARS:
        raise ConfigError(f"target.cpu_linear={value}: use auto (oneDNN linears for fp32 on a CPU where this PyTorch "
                          f"has oneDNN), onednn or aten")
    return linear
