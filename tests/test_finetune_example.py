"""examples/finetune_char_lm.py, reduced: pretrains, exports in Hugging Face's
layout, imports, fine-tunes with LoRA, exports PEFT adapters and merged
weights, and reads the merged weights back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import safetensors.numpy

pytestmark = pytest.mark.slow  # trains two models for seconds

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_char_lm.py"


def test_finetune_char_lm_reduced(tmp_path):
    spec = importlib.util.spec_from_file_location("finetune_char_lm", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    figures = example.main(30, 30, seq=32, batch_size=16, out=str(tmp_path))
    assert figures["new_after"] < figures["new_before"] - 0.2, figures
    assert abs(figures["new_merged"] - figures["new_after"]) < 0.01, figures
    config = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["r"] == 8
    peft = safetensors.numpy.load_file(str(tmp_path / "peft/adapter_model.safetensors"))
    assert len(peft) == 8 and all(
        k.startswith("base_model.model.model.layers.") for k in peft
    )
    assert (tmp_path / "pretrained/config.json").exists()
    assert (tmp_path / "merged/model.safetensors").exists()
