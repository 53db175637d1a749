"""Fine-tuning pretrained models: their weights in, adapters out.

A checkpoint in Hugging Face's layout comes in through a declared
`WeightMapping` (name templates and invertible per-tensor transforms), never
pickle; the frozen base then lives in ``model_without_params`` and the adapters
are the params (DESIGN.md, contract 10).

* `pztrain.finetune._transforms`: `Transpose`, `SplitAxis`, `MergeAxes`, `Slice`;
* `pztrain.finetune._mapping`: `Rule`, `WeightMapping`, the checks of a plan;
* `pztrain.finetune._hf`: the files of Hugging Face's layout, sliced reads;
* `pztrain.finetune._load`: `load_pretrained` and its `ImportReport`;
* `pztrain.finetune._place`: what is read, onto its devices in one copy;
* `pztrain.finetune._export`: `export_pretrained`, the mapping backwards;
* `pztrain.finetune._llama`: the mapping for penzai's Llama-style transformer;
* `pztrain.finetune._lora`, `pztrain.finetune._lora_layers`: low-rank adapters;
* `pztrain.finetune._peft`: adapters in PEFT's layout, out and in.
"""

from pztrain.finetune._export import export_pretrained
from pztrain.finetune._hf import read_config
from pztrain.finetune._llama import (
    hf_llama_config,
    llama_config,
    llama_mapping,
    llama_skeleton,
)
from pztrain.finetune._load import ImportReport, load_pretrained, penzai_skeleton
from pztrain.finetune._lora import LoraConfig, add_lora, is_adapter, merge_lora
from pztrain.finetune._mapping import MappingError, Rule, WeightMapping
from pztrain.finetune._peft import export_peft, load_peft
from pztrain.finetune._transforms import (
    MergeAxes,
    Slice,
    SplitAxis,
    TransformError,
    Transpose,
)

__all__ = [
    "ImportReport",
    "LoraConfig",
    "MappingError",
    "MergeAxes",
    "Rule",
    "Slice",
    "SplitAxis",
    "TransformError",
    "Transpose",
    "WeightMapping",
    "add_lora",
    "export_peft",
    "export_pretrained",
    "hf_llama_config",
    "is_adapter",
    "llama_config",
    "load_peft",
    "llama_mapping",
    "llama_skeleton",
    "load_pretrained",
    "merge_lora",
    "penzai_skeleton",
    "read_config",
]
