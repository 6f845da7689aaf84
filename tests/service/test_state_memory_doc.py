"""docs/hybrid-models.md's memory tables (scripts/state_memory.py): the doc is what the script
renders from the published shapes, measured by the server's own functions on models built
on the meta device; and those functions' state for Mamba-2 is the one its config implies."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
CODESTRAL = "mistralai/Mamba-Codestral-7B-v0.1"


def state_memory():
    if "state_memory" not in sys.modules:  # one module, so its measurements are made once
        spec = importlib.util.spec_from_file_location(
            "state_memory", ROOT / "scripts" / "state_memory.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["state_memory"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["state_memory"]


@pytest.mark.slow  # every published shape probed on the meta device: ~10 s
def test_the_hybrid_models_doc_is_the_table():
    doc = (ROOT / "docs" / "hybrid-models.md").read_text()
    block = re.search(
        r"<!-- state memory table: begin -->\n(.*)<!-- state memory table: end -->\n",
        doc,
        re.DOTALL,
    )
    assert block is not None, "docs/hybrid-models.md has lost its table markers"
    assert block.group(1) == state_memory().render(), (
        "docs/hybrid-models.md is stale: python scripts/state_memory.py --write"
    )


def test_mamba2_state_is_its_conv_window_and_its_ssm_state():
    """Codestral Mamba's state by hand from its config: per layer, a convolution window over
    x, B and C, (expand x hidden + 2 x groups x state size) channels x conv_kernel, and the
    SSM state, heads x head_dim x state size; in the dtypes the probe reports."""
    measured = state_memory().measure(CODESTRAL)
    cfg = measured.config
    conv = (cfg.expand * cfg.hidden_size + 2 * cfg.n_groups * cfg.state_size, cfg.conv_kernel)
    recurrent = (cfg.num_heads, cfg.head_dim, cfg.state_size)
    assert (conv, recurrent) == ((10240, 4), (128, 64, 128))  # the published shape's

    assert sorted(measured.shapes) == list(range(cfg.num_hidden_layers))  # every layer: 64
    total = 0
    for shape in measured.shapes.values():
        (conv_shape, conv_dtype), (recurrent_shape, recurrent_dtype) = shape.conv, shape.recurrent
        assert (conv_shape, recurrent_shape) == (conv, recurrent)
        assert conv_dtype == torch.bfloat16  # the model's dtype
        total += math.prod(conv) * conv_dtype.itemsize
        total += math.prod(recurrent) * recurrent_dtype.itemsize
    assert measured.state_bytes == total
    assert measured.kv_per_token == 0 and measured.attention_layers == 0
