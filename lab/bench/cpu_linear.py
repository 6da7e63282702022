"""What a target forward over q new tokens costs on this CPU, per dtype and linear kernel.

    python -m lab.bench.cpu_linear OUT.json [--target data/smollm2-llava] [--prefix 256]
        [--rows 1 2 3 4 8] [--repeats 30] [--threads 2]

Loads the target three ways (fp32 with PyTorch's linears, fp32 with oneDNN's over packed
weights, bf16), fills a KV cache with ``--prefix`` tokens, then times forwards of q = each
``--rows`` new tokens over it, the settings interleaved round by round so that a load on the
machine falls on all of them alike (median and min of ``--repeats``). Also checks, per
setting, whether the last row's logits are the same bits when computed alone and among
other rows (what keeps a verification's rows equal to the plain step's). Run under
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` to see a CPU
without AVX-512 (and so without native bf16). The JSON names the CPU and those variables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def back_to(cache, length: int) -> None:
    """Drop what a timed forward appended to ``cache`` (crop takes the count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--target", default="data/smollm2-llava")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.prefix < 1 or a.repeats < 1 or a.threads < 1 or min(a.rows) < 1:
        ap.error("--prefix, --repeats, --threads and every --rows must be at least 1")
    if not Path(a.target).is_dir():
        ap.error(f"--target {a.target}: no such folder (build it: python -m lab.targets.make_smollm2_llava)")
    torch.set_num_threads(a.threads)

    from transformers import DynamicCache

    from msd_train.evaluation.cpu_setting import cpu_flags, cpu_identity, native_bf16
    from msd_train.targets import load_target
    from msd_train.targets.cpu_linear import pack_linears

    settings = {"fp32 aten": ("float32", False, "sdpa"), "fp32 onednn": ("float32", True, "sdpa"),
                "fp32 onednn, eager attention": ("float32", True, "eager"),
                "bf16, eager attention": ("bfloat16", False, "eager")}
    torch.manual_seed(0)
    models, caches, rows_equal = {}, {}, {}
    for name, (dtype, pack, attn) in settings.items():
        target = load_target(a.target, dtype, "cpu", attn_implementation=attn)
        if pack:
            pack_linears(target.model)
        lm = target.model
        vocab = target.vocab_size
        ids = torch.randint(5, min(vocab, 30000), (1, a.prefix + max(a.rows)), generator=torch.Generator().manual_seed(1))
        cache = DynamicCache(config=lm.config.get_text_config())
        with torch.inference_mode():
            lm(input_ids=ids[:, : a.prefix], past_key_values=cache, use_cache=True)
            one = lm(input_ids=ids[:, a.prefix: a.prefix + 1], past_key_values=cache, use_cache=True).logits[0, -1]
            back_to(cache, a.prefix)
            two = lm(input_ids=ids[:, a.prefix: a.prefix + 2], past_key_values=cache, use_cache=True).logits[0, 0]
            back_to(cache, a.prefix)
        rows_equal[name] = bool(torch.equal(one, two))
        models[name], caches[name] = (lm, ids), cache
    times = {name: {q: [] for q in a.rows} for name in settings}
    with torch.inference_mode():
        for _ in range(a.repeats + 3):  # 3 warm-up rounds, dropped below
            for q in a.rows:
                for name, (lm, ids) in models.items():
                    cache = caches[name]
                    t0 = time.perf_counter()
                    lm(input_ids=ids[:, a.prefix: a.prefix + q], past_key_values=cache, use_cache=True)
                    times[name][q].append(time.perf_counter() - t0)
                    back_to(cache, a.prefix)
    result = {
        "cpu": cpu_identity(), "native_bf16": native_bf16()[1],
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
        "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")},
        "target": a.target, "prefix": a.prefix, "threads": a.threads, "repeats": a.repeats,
        "command": " ".join(["python -m lab.bench.cpu_linear", *sys.argv[1:]]),
        "ms": {name: {str(q): {"median": round(1e3 * statistics.median(ts[3:]), 2), "min": round(1e3 * min(ts[3:]), 2)}
                      for q, ts in per.items()} for name, per in times.items()},
        "row_alone_equals_row_among_two": rows_equal,
    }
    for name, per in result["ms"].items():
        base = per[str(a.rows[0])]["median"]
        result["ms"][name]["cost_vs_first"] = {q: round(v["median"] / base, 2) for q, v in per.items()
                                               if q != "cost_vs_first"}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, per in result["ms"].items():
        print(f"{name:24s} " + "  ".join(f"q={q}: {per[str(q)]['median']:.1f} ms" for q in a.rows)
              + f"   rows equal alone/among 2: {rows_equal[name]}")


if __name__ == "__main__":
    main()
