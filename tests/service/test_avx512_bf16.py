"""textgen's CPU kernels for int4 and int8 weights (service/models/avx512_bf16.py): which CPUs
take them (the flags of /proc/cpuinfo), and a host where they fail to compile keeps torch's
kernels with a warning, once."""

from __future__ import annotations

import pytest
import torch
from support.compilers import without_cpp_compiler
from textgen.service.models import avx512_bf16
from textgen.service.models import quantize as q
from textgen.service.models.small_steps import SMALL_STEP_ROWS, add_small_step_weights

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("flags", "supported"),
    [
        ("fpu avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni", True),
        ("fpu avx512f avx512bw avx512vl avx512dq avx512_vnni", False),  # no bf16: torch's
        ("fpu avx2 fma", False),
    ],
)
def test_cpu_support_reads_the_flags(tmp_path, flags, supported):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert avx512_bf16.cpu_supports(str(cpuinfo)) is supported
    assert avx512_bf16.cpu_supports(str(tmp_path / "missing")) is False


def test_a_failed_compile_keeps_torchs_kernels_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(avx512_bf16, "cpu_supports", lambda: True)
    monkeypatch.setattr(avx512_bf16, "_loaded", None)  # tried again, and put back after
    without_cpp_compiler(monkeypatch)
    int4, int8, copied = (
        torch.nn.Sequential(torch.nn.Linear(64, 128)).to(torch.bfloat16) for _ in range(3)
    )
    with caplog.at_level("WARNING", logger="textgen.models"):
        assert q.quantize_model(int4, "int4", CPU) == {"int4": 1}
        assert q.quantize_model(int8, "int8", CPU) == {"int8": 1}
        assert add_small_step_weights(copied) == 1
    assert type(int4[0]) is q.Int4Linear and type(int8[0]) is q.Int8Linear
    assert not copied[0].packed and copied[0].max_rows == SMALL_STEP_ROWS[torch.bfloat16]
    assert caplog.text.count("AVX512-BF16 kernels did not compile") == 1  # tried once
    assert avx512_bf16.available() is False
