"""A GGUF model loaded with its quantized weights kept quantized: the file's tensors under
transformers' parameter names, and a model skeleton holding them.

Transformers' own GGUF loading dequantizes every weight to float (4 bytes a weight in fp32).
Here the config comes from transformers, and the names and tensor fix-ups follow its GGUF loader,
so both agree with `from_pretrained(folder, gguf_file=...)`; only the tensors take another path
(worker/model/gguf_blocks.py). Where transformers' tensor processor reorders rows (llama.cpp permutes
llama's q and k rows for its rope layout; transformers undoes that), the same order is applied to
the quantized rows, so every weight dequantizes to exactly what transformers loads.

Contract with the model runner: `build_model` returns the transformers model with float weights
in place, and for every weight that is quantized (linear projections, and the embedding where
the file quantizes it) the module's `weight` is an empty tensor and `module.quantized` holds the
QuantizedWeight. A tied `lm_head` shares the embedding's weight and QuantizedWeight object.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from worker.model.gguf_blocks import TensorReader, read_tensor, tensor_dims
from worker.model.quantized import QuantizedWeight

log = logging.getLogger(__name__)

Weights = dict[str, QuantizedWeight | torch.Tensor]


def gguf_config(path: str | Path):
    """The transformers config of a GGUF file, as `from_pretrained(folder, gguf_file=name)` makes
    it. Slow for a large vocabulary (transformers parses all the metadata, entry by entry)."""
    from transformers import AutoConfig  # heavy, worker side only

    path = Path(path)
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def _empty_model(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM of `config` with its parameters on the meta device (no memory) and its
    buffers (rotary frequencies, embedding scales) computed on the CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _processor(architecture: str, config):
    """transformers' tensor processor for the architecture, if this loader can reproduce what it
    does: nothing (most architectures), llama's q/k row order, gemma's norm offset (1-D only).
    transformers exports no public API for its GGUF name and tensor mapping: this reads its
    modeling_gguf_pytorch_utils (an internal module, the one its own from_pretrained uses);
    tests/unit/test_gguf_weights.py checks the result against transformers' own load of the file."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        TensorProcessor,
    )

    cls = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if cls not in (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor):
        raise NotImplementedError(
            f"GGUF architecture {architecture!r} needs transformers' {cls.__name__}, which this quantized "
            "loader does not reproduce; load it dequantized with from_pretrained(..., gguf_file=...)"
        )
    return cls(config=config.to_dict())


def _names(model: nn.Module, architecture: str, num_layers: int, processor) -> dict[str, str]:
    """{GGUF tensor name: transformers parameter name}, as transformers' get_gguf_hf_weights_map
    finds it for these models, with gguf's name table built once (that helper rebuilds it for
    every submodule: seconds, for a model of hundreds of modules)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((a for a, n in MODEL_ARCH_NAMES.items() if n == architecture), None)
    if arch is None:
        raise NotImplementedError(f"this gguf package does not know the architecture {architecture!r}")
    table = get_tensor_name_map(arch, num_layers)
    names = {}
    for hf_name in model.state_dict():
        hf_name = processor.preprocess_name(hf_name)
        base, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            base, _, suffix = hf_name.rpartition(".")
            suffix = "." + suffix
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names[gguf_name + suffix] = hf_name
    return names


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """The row permutation transformers' processor applies to the weight `name` (None when it keeps
    the order), found by running the processor on the row indices."""
    probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    out = np.asarray(processor.process(weights=probe, name=name).weights)
    if out.shape != probe.shape or not np.array_equal(np.sort(out[:, 0]), probe[:, 0]):
        raise NotImplementedError(f"transformers changes {name!r} beyond reordering its rows: "
                                  "it cannot be kept quantized")
    order = out[:, 0].astype(np.int64)
    return None if np.array_equal(order, np.arange(rows)) else order


def _read(tensor, processor, dequantize_unsupported: bool) -> QuantizedWeight | torch.Tensor:
    """A file tensor as transformers loads it: a 1-D one (norm, bias) through the processor in fp32,
    as transformers does; a larger one, quantized or not, in the row order transformers gives it."""
    dims = tensor_dims(tensor)
    if len(dims) == 1:
        value = read_tensor(tensor, dequantize_unsupported=True).to(torch.float32).numpy()
        return torch.from_numpy(np.array(processor.process(weights=value, name=tensor.name).weights, np.float32))
    order = _row_order(processor, tensor.name, dims[0])
    return read_tensor(tensor, dequantize_unsupported, row_order=order)


def load_gguf(path: str | Path, config=None, dequantize_unsupported: bool = False):
    """The config and the weights of a GGUF file: {transformers parameter name: QuantizedWeight for
    a block-quantized weight, a tensor of the file's dtype for an F32/F16/BF16 one; fp32 for 1-D}.

    Tensors transformers does not map (e.g. llama.cpp's rope_freqs) are left out as it does; a tied
    lm_head is not in the dict (build_model ties it). Block types other than those of
    gguf_blocks.DECODERS raise UnsupportedTensorType unless `dequantize_unsupported`.
    Every tensor is copied out of the file: nothing keeps it mapped.

    `config` skips computing it again (gguf_config parses the whole file's metadata, tokenizer
    included: most of the load time); pass one only if it came from gguf_config of this file.
    """
    config = gguf_config(path) if config is None else config
    reader = TensorReader(path)
    architecture = str(reader.fields["general.architecture"].contents())
    processor = _processor(architecture, config)
    names = _names(_empty_model(config, torch.float32), architecture, config.num_hidden_layers, processor)
    weights: Weights = {}
    for tensor in reader.tensors:
        if tensor.name not in names:
            log.debug("GGUF tensor %s has no transformers parameter: skipped", tensor.name)
            continue
        weights[names[tensor.name]] = _read(tensor, processor, dequantize_unsupported)
    return config, weights


def build_model(config, weights: Weights, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM of `config` holding `weights` (from load_gguf), in eval mode.

    Float tensors become the parameters (cast to `dtype`); a quantized weight leaves its module an
    empty `weight` of `dtype` and sets `module.quantized`. A tied lm_head shares the embedding's
    parameter and QuantizedWeight. Raises if a parameter is missing or its shape differs.
    """
    model = _empty_model(config, dtype)
    for name, value in weights.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        expected = tuple(getattr(module, attr).shape)
        if tuple(value.shape) != expected:
            raise ValueError(f"{name}: the file has shape {tuple(value.shape)}, the model wants {expected}")
        if isinstance(value, QuantizedWeight):
            module.quantized = value
            value = torch.empty(0, dtype=dtype)
        module._parameters[attr] = nn.Parameter(value.to(dtype), requires_grad=False)
    if getattr(config, "tie_word_embeddings", False):
        inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
        if outputs is not None and outputs.weight.is_meta:
            outputs.weight = inputs.weight
            if hasattr(inputs, "quantized"):
                outputs.quantized = inputs.quantized
    missing = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    if missing:
        raise ValueError(f"the GGUF file has no weights for {missing}")
    return model.eval()
