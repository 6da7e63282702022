"""What eval.py loads the target with on a CPU: the dtype for the machine, and fp32 linears on
oneDNN whose rows do not depend on how many are computed together (so verification rows equal
the plain step's)."""

from pathlib import Path

import pytest
import torch

from msd_train.evaluation.cpu_setting import choose, cpu_identity, native_bf16
from msd_train.targets.cpu_linear import PackedLinear, onednn_available, pack_linears

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
CPU = torch.device("cpu")


def test_native_bf16_needs_the_flag_and_lets_oneDNN_limit_it():
    assert not native_bf16({"avx2", "avx512f"}, {})[0]
    has, why = native_bf16({"avx2", "avx512f", "avx512_bf16"}, {})
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert has and "avx512_bf16" in why
    else:  # PyTorch itself runs below AVX-512 here: bf16 is not native for it
        assert not has and "ATEN_CPU_CAPABILITY" in why
    has, why = native_bf16({"amx_bf16", "avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not has and "ONEDNN_MAX_CPU_ISA" in why


def test_a_report_names_the_cpu_generation_and_its_vector_extensions(tmp_path):
    """"AMD EPYC" alone covers Zen 4 and Zen 5, whose speedups differ: family, model and the
    extensions that decide decoding speed go with it (every processor block after the first ignored)."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                    "model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu avx avx2 avx512f avx512_bf16 "
                    "avx512_vp2intersect avx_vnni\n\nprocessor\t: 1\ncpu family\t: 25\nflags\t\t: avx2\n")
    assert cpu_identity(info) == ("AMD EPYC (family 26, model 2, stepping 1; AVX-512 BF16, AVX-512 VP2INTERSECT, "
                                  "AVX-512, AVX-VNNI, AVX2)")
    info.write_text("model name\t: Some CPU\nflags\t\t: sse2\n")
    assert cpu_identity(info) == "Some CPU"
    assert cpu_identity(tmp_path / "missing")  # not Linux: the platform's name, never an error


def test_a_reports_device_gives_back_the_cpu_it_names():
    """What a study reads back from a report's ``device`` (its CPU column) is what the report named."""
    from msd_train.evaluation.run import describe_device, described_cpu

    assert described_cpu(describe_device(CPU)) == cpu_identity()
    assert described_cpu("NVIDIA H200 (cuda)") is None and described_cpu(None) is None


def test_auto_on_a_cpu_is_fp32_on_onednn_else_by_native_bf16(monkeypatch):
    import msd_train.evaluation.cpu_setting as cs
    import msd_train.targets.cpu_linear as cl

    monkeypatch.setattr(cs, "native_bf16", lambda flags: (True, "native bf16"))
    monkeypatch.setattr(cl, "onednn_available", lambda: True)
    s = choose({"dtype": "auto", "attn_implementation": "auto"}, CPU)
    assert (s.dtype, s.attn_implementation, s.linear) == ("float32", "sdpa", "onednn")
    assert "oneDNN" in s.why and "native bf16" in s.why  # the choice and what the CPU has
    # without oneDNN: bf16 (eager attention, exact rows) only where the CPU has it natively
    monkeypatch.setattr(cl, "onednn_available", lambda: False)
    monkeypatch.setattr(cs, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    s = choose({"dtype": "auto", "attn_implementation": "auto"}, CPU)
    assert (s.dtype, s.attn_implementation, s.linear) == ("bfloat16", "eager", "aten")
    # on an AMX CPU bf16 verification rounds apart from the plain step (chains part from plain decoding): fp32
    monkeypatch.setattr(cs, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_bf16"})
    s = choose({"dtype": "auto", "attn_implementation": "auto"}, CPU)
    assert (s.dtype, s.attn_implementation, s.linear) == ("float32", "sdpa", "aten") and "AMX" in s.why
    monkeypatch.setattr(cs, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert choose({"dtype": "auto", "attn_implementation": "auto"}, CPU).dtype == "bfloat16"
    monkeypatch.setattr(cs, "native_bf16", lambda flags: (False, "no native bf16"))
    s = choose({"dtype": "auto", "attn_implementation": "auto"}, CPU)
    assert (s.dtype, s.attn_implementation, s.linear) == ("float32", "sdpa", "aten") and "no native bf16" in s.why
    # what the user gives is kept
    monkeypatch.setattr(cl, "onednn_available", lambda: True)
    s = choose({"dtype": "fp32", "attn_implementation": "eager", "cpu_linear": "aten"}, CPU)
    assert (s.dtype, s.attn_implementation, s.linear) == ("float32", "eager", "aten")
    s = choose({"dtype": "bfloat16", "attn_implementation": "auto"}, CPU)
    assert (s.dtype, s.attn_implementation, s.linear) == ("bfloat16", "eager", "aten")
    with pytest.raises(ValueError, match="target.cpu_linear=fast"):
        choose({"cpu_linear": "fast"}, CPU)


@needs_onednn
def test_packed_linear_rows_do_not_depend_on_the_row_count():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 300)
    packed = PackedLinear(lin)
    x = torch.randn(2, 9, 96)
    with torch.inference_mode():
        full = packed(x)
        torch.testing.assert_close(full, lin(x), rtol=1e-5, atol=1e-5)
        for rows in (1, 2, 3, 5):  # the first row alone and among others: the same bits
            assert torch.equal(packed(x[0, :rows])[0], full[0, 0])
    assert packed.weight is lin.weight  # heads read lm_head.weight
    # where autograd records, the layer is plain F.linear (and gradients flow)
    y = torch.randn(3, 96, requires_grad=True)
    packed(y).sum().backward()
    assert y.grad is not None


@needs_onednn
def test_packing_the_tiny_target_keeps_its_logits():
    from msd_train.targets import load_target

    folder = str(Path(__file__).resolve().parents[2] / "data" / "tiny-llava")
    plain, packed = load_target(folder, "float32", "cpu"), load_target(folder, "float32", "cpu", onednn_linears=True)
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.inference_mode():
        before = plain.model(input_ids=ids).logits
        after = packed.model(input_ids=ids).logits
    assert isinstance(packed.lm_head, PackedLinear) and not isinstance(plain.lm_head, PackedLinear)
    assert pack_linears(packed.model) == 0  # nothing left to pack
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_a_heads_target_name_holds_no_path_of_the_training_machine(tmp_path):
    """What a head's config records as its target (issue: an absolute path of the machine
    that trained it): a Hub id as given, the checkout's folders relative, others by name."""
    from msd_train.paths import portable_name

    assert portable_name("llava-hf/llava-1.5-7b-hf") == "llava-hf/llava-1.5-7b-hf"
    (tmp_path / "data" / "smollm2-llava").mkdir(parents=True)
    assert portable_name(str(tmp_path / "data" / "smollm2-llava"), root=tmp_path) == "data/smollm2-llava"
    (tmp_path / "elsewhere" / "my-target").mkdir(parents=True)
    assert portable_name(str(tmp_path / "elsewhere" / "my-target"), root=tmp_path / "data") == "my-target"


def test_committed_heads_name_their_target_portably():
    import json

    for config in (Path(__file__).resolve().parents[2] / "data" / "smollm2-llava-heads").glob("*/config.json"):
        name = json.loads(config.read_text())["target_name_or_path"]
        assert not Path(name).is_absolute(), (config, name)
