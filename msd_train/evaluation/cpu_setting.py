"""The target's dtype, attention and linear kernels for decoding, chosen for the machine.

``target.dtype=auto`` on CUDA is bf16, as everywhere in the field. On a CPU it is **fp32 with
every linear layer on oneDNN over a weight packed once** (``msd_train.targets.cpu_linear``):
a forward over a few tokens then costs about what one token's does, so a verification costs
about one plain step, and the outputs equal plain decoding. Measured on SmolLM2-135M
(``benchmarks/real_lm/README.md``, "Any CPU"), that decodes as fast as bf16 on a CPU with
AVX-512 BF16 (1.30x vs 1.31x plain decoding), with no bf16 rounding ties, and much faster than
PyTorch's own fp32 linears (MKL: k rows cost ~k rows; 0.82x on a CPU without native bf16). On an
AMX CPU bf16 is faster (1.83x against 1.55x) but parts from plain decoding at near ties: fp32 stays.
Where this PyTorch has no oneDNN, a CPU with native bf16 (AVX-512 BF16, and oneDNN allowed to
use it) gets bf16 with eager attention (chains bit-exact with the two-row plain step,
``decoding.plain_rows=auto``; trees exact up to bf16 rounding ties), any other fp32, AMX CPUs
included: there bf16 verification rounds apart from the plain step somewhere in the forward (not
pinned), and bf16 chains part from plain decoding at near ties (measured: ``benchmarks/real_lm/results/machine_c/``).

A dtype or attention given explicitly is kept; ``target.cpu_linear`` (auto | onednn | aten)
picks the fp32 kernels (auto: oneDNN on a CPU). ``choose(tc, device)`` returns the choice and
why; eval.py prints it and writes it to report.json under ``"target_setting"``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from msd_train.checks import ONEDNN_ISAS as _ONEDNN_ISAS
from msd_train.checks import check_cpu_linear, onednn_max_isa
from msd_train.runtime import resolve_dtype

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass
class CPUSetting:
    dtype: str
    attn_implementation: str
    linear: str        # onednn | aten
    why: str

    def as_dict(self) -> dict:
        return asdict(self)


def _first_cpu(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, str] | None:
    """The first processor's block of ``cpuinfo`` as key -> value (None where it cannot be read)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (Linux; empty elsewhere)."""
    return set((_first_cpu(cpuinfo) or {}).get("flags", "").split())


#: the vector extensions that decide a CPU's decoding speed here, named in reports (widest first)
_NAMED_FLAGS = (("amx_bf16", "AMX BF16"), ("avx512_bf16", "AVX-512 BF16"), ("avx512_vp2intersect", "AVX-512 VP2INTERSECT"),
                ("avx512f", "AVX-512"), ("avx_vnni", "AVX-VNNI"), ("avx2", "AVX2"))


def named_extensions(flags: set[str]) -> list[str]:
    """The vector extensions among ``flags`` that a result names, widest first (``_NAMED_FLAGS``)."""
    return [name for flag, name in _NAMED_FLAGS if flag in flags]


def cpu_identity(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU as a result should name it: its model name, family / model / stepping (a model name
    such as "AMD EPYC" covers several generations) and the vector extensions it has, e.g.
    ``AMD EPYC (family 25, model 17, stepping 1; AVX-512 BF16, AVX-512, AVX2)``."""
    fields = _first_cpu(cpuinfo)
    if fields is None:
        import platform

        return platform.processor() or platform.machine() or "unknown CPU"
    ids = [f"{name} {fields[key]}" for key, name in (("cpu family", "family"), ("model", "model"), ("stepping", "stepping"))
           if fields.get(key)]
    named = named_extensions(set(fields.get("flags", "").split()))
    detail = "; ".join(x for x in (", ".join(ids), ", ".join(named)) if x)
    return f"{fields.get('model name', 'unknown CPU')}" + (f" ({detail})" if detail else "")


def native_bf16(flags: set[str] | None = None, env: dict | None = None) -> tuple[bool, str]:
    """Whether bf16 products run natively here, and the evidence: the CPU's flags, PyTorch's
    kernel level (``ATEN_CPU_CAPABILITY`` can lower it) and oneDNN's (``ONEDNN_MAX_CPU_ISA``)."""
    flags = cpu_flags() if flags is None else flags
    env = os.environ if env is None else env
    have = [f for f in _BF16_FLAGS if f in flags]
    if not have:
        return False, "the CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag)"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        return False, f"the CPU has {'/'.join(have)}, but PyTorch's kernels run at {capability} (ATEN_CPU_CAPABILITY)"
    isa = onednn_max_isa(env)
    if _ONEDNN_ISAS.index(isa) < _ONEDNN_ISAS.index("AVX512_CORE_BF16"):
        return False, f"the CPU has {'/'.join(have)}, but oneDNN is limited to {isa} (ONEDNN_MAX_CPU_ISA)"
    return True, f"the CPU has native bf16 ({'/'.join(have)}, PyTorch at {capability})"


def choose(tc: dict, device: torch.device) -> CPUSetting:
    """The dtype, attention and linear kernels eval.py loads the target with (module docstring)."""
    dtype, attn = str(tc.get("dtype") or "auto"), str(tc.get("attn_implementation") or "auto")
    linear = check_cpu_linear(tc.get("cpu_linear"))
    if device.type != "cpu":
        resolved = resolve_dtype(dtype, device)
        return CPUSetting(_name(resolved), "sdpa" if attn == "auto" else attn, "aten",
                          f"{device.type}: dtype {dtype}")
    from msd_train.targets.cpu_linear import onednn_available

    onednn = linear != "aten" and onednn_available()
    if dtype == "auto":
        flags = cpu_flags()
        bf16, cpu = native_bf16(flags)
        if onednn:
            dtype, why = "float32", (f"float32 with oneDNN linears: a verification costs little more than one plain "
                                     f"step, and exact where bf16 can part at near ties ({cpu})")
        elif bf16 and "amx_bf16" in flags:
            dtype, why = "float32", (f"{cpu}, but on AMX bf16 verification rounds apart from the plain step (bf16 "
                                     "chains part from plain decoding at near ties there): float32")
        else:
            dtype = "bfloat16" if bf16 else "float32"
            why = f"{cpu}: {dtype}"
    else:
        dtype, why = _name(resolve_dtype(dtype, device)), f"target.dtype={dtype} as given"
    if attn == "auto":
        attn = "eager" if dtype != "float32" else "sdpa"
        why += f", {attn} attention" + (" (exact rows in bf16)" if attn == "eager" else "")

    use = dtype == "float32" and onednn
    if linear == "onednn" and not use:
        why += "; target.cpu_linear=onednn not applied (" + ("not fp32" if dtype != "float32" else
                                                              "this PyTorch has no oneDNN") + ")"
    return CPUSetting(dtype, attn, "onednn" if use else "aten", why)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
