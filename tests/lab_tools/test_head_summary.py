"""head_summary names each CPU kind after the machine its timings recorded, not a fixed string."""

from lab.studies.real_lm.head_summary import cpu_name

AVX512_BF16 = ["avx2", "avx512f", "avx512_bf16"]


def test_the_native_kind_is_named_after_the_recorded_cpu_and_its_widest_extension():
    assert cpu_name("native", {"cpu": "AMD EPYC", "cpu_flags": AVX512_BF16, "threads": 2}) == \
        "AMD EPYC, AVX-512 BF16 (2 cores)"
    # a newer record's bracketed family and extensions do not make a second key for the same CPU
    assert cpu_name("native", {"cpu": "AMD EPYC (family 25, model 17; AVX-512 BF16)", "cpu_flags": AVX512_BF16,
                               "threads": 2}) == "AMD EPYC, AVX-512 BF16 (2 cores)"
    assert cpu_name("native", {"cpu": "Intel Xeon", "cpu_flags": ["avx2", "avx512f"], "threads": 4}) == \
        "Intel Xeon, AVX-512 (4 cores)"
    assert cpu_name("native", {"cpu": "Intel Core", "cpu_flags": ["avx2"], "threads": 8}) == "Intel Core, AVX2 (8 cores)"


def test_the_avx2_kind_names_the_settings_that_limited_it():
    name = cpu_name("avx2", {"cpu": "AMD EPYC", "cpu_flags": AVX512_BF16, "threads": 2,
                             "env": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "UNSET": None}})
    assert name == "the same CPU limited to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2): no native bf16"
