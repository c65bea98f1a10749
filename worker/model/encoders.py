"""Encoder models run on packed inputs: a step's inputs lie back to back in one row of tokens,
never padded to the longest; every projection runs once over the whole row, and attention runs per
input (each sees its own tokens only, both ways). The families: worker/model/encoder_forwards.py.

The weights are transformers' modules, loaded as transformers loads them; the forward here is
ours, so that inputs of any lengths share a step without padding. What comes after the encoder
is sentence-transformers' (shared/pooling_model.py): Pooling, Dense, Normalize for an embedding
model; the classification head and the saved activation for a cross-encoder.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.pooling_model import Dense, PoolingModel
from worker.model.encoder_forwards import FORWARDS

_POOLERS = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "mpnet"})  # models built with a pooler
ACTIVATION: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "gelu": F.gelu}


@dataclass(frozen=True)
class Packed:
    """A step's inputs, back to back: token ids, each token's segment (0 for a pair's first text,
    1 for its second), and each input's length."""

    ids: torch.Tensor
    types: torch.Tensor
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, inputs: list[tuple[list[int], int]], device: torch.device) -> Packed:
        """`inputs`: each input's tokens, and where its second segment begins (its length: none)."""
        ids = [t for tokens, _ in inputs for t in tokens]
        types = [int(i >= split) for tokens, split in inputs for i in range(len(tokens))]
        return cls(torch.tensor(ids, dtype=torch.long, device=device),
                   torch.tensor(types, dtype=torch.long, device=device), tuple(len(t) for t, _ in inputs))

    def positions(self, offset: int = 0) -> torch.Tensor:
        """Each token's position in its own input, from `offset`."""
        return torch.cat([torch.arange(offset, offset + n, device=self.ids.device) for n in self.lengths])

    def spans(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.lengths:
            out.append((start, start + n))
            start += n
        return out


class Encoder:
    """One encoder model and what follows it: `embed` gives each input's embedding, `classify` its
    scores (after the cross-encoder's activation)."""

    def __init__(self, model: torch.nn.Module, description: PoolingModel, dense: list[torch.nn.Linear],
                 matmul_dtype: torch.dtype | None = None):
        self.model = model.eval()
        # Where set: the projections and attention compute in this dtype (torch.autocast) while the
        # weights, norms and the residual stream stay in theirs (dtype auto on a CPU with fast bf16).
        self.matmul_dtype = matmul_dtype
        self.description = description
        self.config = model.config
        self.family = model.config.model_type
        self.base = model.base_model
        self.dense = dense
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def hidden(self, packed: Packed) -> torch.Tensor:
        """Every token's final hidden state, (tokens, hidden size)."""
        if self.matmul_dtype is None:
            return FORWARDS[self.family](self.model, packed)
        with torch.autocast(self.device.type, dtype=self.matmul_dtype):
            return FORWARDS[self.family](self.model, packed).to(self.dtype)

    @property
    def numerics(self) -> str:
        """What it computes in: the weights' dtype, and the matmuls' where autocast lowers them."""
        name = str(self.dtype).removeprefix("torch.")
        return name if self.matmul_dtype is None else f"{name}, {str(self.matmul_dtype).removeprefix('torch.')} matmuls"

    # -- what follows the encoder -----------------------------------------------------------
    @torch.inference_mode()
    def embed(self, packed: Packed, skips: list[int]) -> list[torch.Tensor]:
        """Each input's embedding, as sentence-transformers' modules make it; skips[i]: input i's
        prompt tokens left out of its pooling (a Pooling with include_prompt false)."""
        hidden = self.hidden(packed).float()
        d = self.description
        out = []
        for (start, end), skip in zip(packed.spans(), skips):
            tokens = hidden[start + (0 if d.include_prompt else skip):end]
            value = torch.cat([_pool(mode, tokens) for mode in d.modes])
            for module, linear in zip(d.dense, self.dense):
                value = ACTIVATION[module.activation](linear(value))
            if d.normalize:
                value = F.normalize(value, dim=0)
            out.append(value)
        return out

    @torch.inference_mode()
    def classify(self, packed: Packed) -> list[torch.Tensor]:
        """Each input's scores: the model's classification head, then the saved activation."""
        hidden = self.hidden(packed)
        first = hidden[[start for start, _ in packed.spans()]]
        head = self.model.classifier
        if self.family in ("bert", "nomic_bert"):  # the pooler (dense, tanh) on the first token, then a linear
            logits = head(self.base.pooler.dense(first).tanh())
        elif self.family == "modernbert":  # the first token or the mean, then dense, activation, norm
            if self.config.classifier_pooling == "mean":
                first = torch.stack([hidden[a:b].mean(dim=0) for a, b in packed.spans()])
            logits = head(self.model.head(first))
        else:  # RoBERTa's and MPNet's head: dense, tanh, out_proj
            logits = head.out_proj(head.dense(first).tanh())
        return list(ACTIVATION[self.description.activation](logits.float()))


def _pool(mode: str, tokens: torch.Tensor) -> torch.Tensor:
    if mode == "cls":
        return tokens[0]
    if mode == "lasttoken":
        return tokens[-1]
    if mode == "max":
        return tokens.max(dim=0).values
    if mode == "mean":
        return tokens.mean(dim=0)
    if mode == "mean_sqrt_len_tokens":
        return tokens.sum(dim=0) / tokens.shape[0] ** 0.5
    if mode == "weightedmean":
        weights = torch.arange(1, tokens.shape[0] + 1, dtype=tokens.dtype, device=tokens.device)
        return (tokens * weights[:, None]).sum(dim=0) / weights.sum()
    raise ValueError(f"unknown pooling mode {mode!r}")


def load(folder: Path, description: PoolingModel, device: torch.device, dtype: torch.dtype,
         matmul_dtype: torch.dtype | None = None) -> Encoder:
    """The encoder of `folder` (a sentence-transformers folder or a transformers one), its weights
    in `dtype`, its matmuls in `matmul_dtype` where given (Encoder)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    where = folder / description.transformer_path
    auto = AutoModelForSequenceClassification if description.kind == "classify" else AutoModel
    family = json.loads((where / "config.json").read_text()).get("model_type")
    # An embedding never reads the pooler (a dense and tanh on the first token, for classifiers):
    # not built, so a checkpoint without one (a GGUF's) loads as whole as one with it.
    extra = {"add_pooling_layer": False} if description.kind == "embed" and family in _POOLERS else {}
    model = auto.from_pretrained(where, dtype=dtype, **extra).to(device)
    dense = [_load_dense(folder, module, device) for module in description.dense]
    return Encoder(model, description, dense, matmul_dtype)


def _load_dense(folder: Path, module: Dense, device: torch.device) -> torch.nn.Linear:
    path = folder / module.path
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file
        state = load_file(path / "model.safetensors")
    else:
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias)
    linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
    return linear.to(device).float().eval()
