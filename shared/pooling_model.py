"""What an encoder model computes, read from its folder as sentence-transformers reads it: the
embedding model's modules (`modules.json`: the transformer, Pooling, Dense layers, Normalize), its
named prompts (`config_sentence_transformers.json`), its input limit (`sentence_bert_config.json`),
and whether it is a cross-encoder (a `…ForSequenceClassification`) with its activation.

Both sides read it: the worker runs the modules (worker/model/encoders.py), the api picks the
prompt, checks lengths and `dimensions`, and routes a rerank to a cross-encoder. No torch here.
A worker publishes the description with its tokenizer (PUBLISHED), so an api replica that never
saw the folder knows it too.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

PUBLISHED = "streamq_pooling.json"  # the description, beside the tokenizer files a worker publishes

# transformers model types of the encoders the worker runs (worker/model/encoders.py FAMILIES)
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "mpnet", "nomic_bert", "modernbert"})
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
ACTIVATIONS = {"Tanh": "tanh", "Sigmoid": "sigmoid", "Identity": "identity", "ReLU": "relu", "GELU": "gelu"}


class UnsupportedEncoder(ValueError):
    """The folder asks for something the worker does not run (a module, a pooling mode)."""


@dataclass(frozen=True)
class Dense:
    """A sentence-transformers Dense module: a linear layer and its activation."""

    path: str  # its folder in the model's, with config.json and the weights
    in_features: int
    out_features: int
    bias: bool
    activation: str  # an ACTIVATIONS value


@dataclass(frozen=True)
class PoolingModel:
    kind: Literal["embed", "classify"]
    transformer_path: str = ""  # the transformer's folder in the model's ("" for most)
    modes: tuple[str, ...] = ("mean",)  # embed: Pooling's modes, concatenated in this order
    include_prompt: bool = True  # embed: whether a prompt's tokens are pooled with the text's
    dense: tuple[Dense, ...] = ()
    normalize: bool = False
    dimensions: int = 0  # embed: the embedding's size after every module
    matryoshka: tuple[int, ...] = ()  # sizes the model was trained to be cut to (empty: none)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # the most tokens an input may have (sentence_bert_config.json)
    do_lower_case: bool = False
    num_labels: int = 1  # classify: the classifier's outputs
    activation: str = "identity"  # classify: applied to its logits (sentence-transformers' CrossEncoder)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PoolingModel:
        data = json.loads(text)
        data["dense"] = tuple(Dense(**d) for d in data.get("dense", ()))
        for key in ("modes", "matryoshka"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)

    def prompt(self, name: str | None) -> str:
        """The text put before an input: the named prompt, else the default one, else none."""
        if name is None:
            return self.prompts.get(self.default_prompt_name, "") if self.default_prompt_name else ""
        if name not in self.prompts:
            raise KeyError(name)
        return self.prompts[name]


def is_encoder(config: dict[str, Any]) -> bool:
    """An encoder the worker runs; Gemma 3 only with bidirectional attention (EmbeddingGemma)."""
    kind = config.get("model_type")
    return kind in ENCODER_TYPES or (kind == "gemma3_text" and bool(config.get("use_bidirectional_attention")))


def read(folder: Path) -> PoolingModel | None:
    """The published description, else the one the folder's files give; None for a model that is
    not an encoder (a decoder: it generates, and pools its own way: worker/engine/pooling.py)."""
    published = folder / PUBLISHED
    if published.is_file():
        return PoolingModel.from_json(published.read_text())
    return describe(folder)


def describe(folder: Path) -> PoolingModel | None:
    modules = _json(folder / "modules.json") or []
    transformer = next((m.get("path", "") for m in modules if _type(m) == "Transformer"), "")
    config = _json(folder / transformer / "config.json") or _json(folder / "config.json") or {}
    if not is_encoder(config):
        return None
    st = _json(folder / "config_sentence_transformers.json") or {}
    bert_config = _json(folder / transformer / "sentence_bert_config.json") or _json(
        folder / "sentence_bert_config.json") or {}
    common = dict(transformer_path=transformer, prompts=dict(st.get("prompts") or {}),
                  default_prompt_name=st.get("default_prompt_name"),
                  max_seq_length=bert_config.get("max_seq_length"),
                  do_lower_case=bool(bert_config.get("do_lower_case", False)))
    if config.get("model_type") == "gemma3_text" and config.get("attn_logit_softcapping"):
        raise UnsupportedEncoder(f"{folder}: attention logit softcapping is not run by this server's encoders")
    if _classifies(config, st, bert_config):
        if config.get("model_type") == "gemma3_text":
            raise UnsupportedEncoder(f"{folder}: a Gemma 3 classifier is not served as a cross-encoder here")
        labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 1)
        return PoolingModel("classify", num_labels=labels, activation=_activation_of(config, st, labels), **common)
    hidden = int(config["hidden_size"])
    modes, include_prompt, dense, normalize = ("mean",), True, [], False
    for module in modules:  # without modules.json, sentence-transformers mean-pools, unnormalized
        kind, path = _type(module), module.get("path", "")
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            modes, include_prompt = _pooling(_json(folder / path / "config.json") or {})
        elif kind == "Dense":
            dense.append(_dense(folder, path))
        elif kind == "Normalize":
            normalize = True
        else:
            raise UnsupportedEncoder(f"{folder}: the sentence-transformers module {module.get('type')!r} "
                                     "is not run by this server (Transformer, Pooling, Dense, Normalize are)")
    dimensions = dense[-1].out_features if dense else hidden * len(modes)
    matryoshka = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
    if config.get("is_matryoshka") and not matryoshka:
        matryoshka = tuple(d for d in (2 ** i for i in range(5, 16)) if d <= dimensions)
    return PoolingModel("embed", modes=modes, include_prompt=include_prompt, dense=tuple(dense), normalize=normalize,
                        dimensions=dimensions, matryoshka=matryoshka, **common)


def _classifies(config: dict, st: dict, bert_config: dict) -> bool:
    return (any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or ())
            or st.get("model_type") == "CrossEncoder"
            or bert_config.get("transformer_task") == "sequence-classification")


def _activation_of(config: dict, st: dict, labels: int) -> str:
    """sentence-transformers' CrossEncoder activation: the one saved with the model (a torch.nn
    class), else sigmoid for one label and none for more."""
    path = st.get("activation_fn") or (config.get("sentence_transformers") or {}).get("activation_fn") \
        or config.get("sbert_ce_default_activation_function")
    if path:
        name = path.rsplit(".", 1)[-1]
        if name not in ACTIVATIONS or not path.startswith("torch."):
            raise UnsupportedEncoder(f"the cross-encoder's activation {path!r} is not one this server runs "
                                     f"({sorted(ACTIVATIONS)} of torch.nn)")
        return ACTIVATIONS[name]
    return "sigmoid" if labels == 1 else "identity"


def _pooling(config: dict) -> tuple[tuple[str, ...], bool]:
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [name for key, name in _LEGACY_MODES.items() if config.get(key)] or ["mean"]
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    if bad := [m for m in modes if m not in POOLING_MODES]:
        raise UnsupportedEncoder(f"pooling modes {bad} are not among {POOLING_MODES}")
    return modes, bool(config.get("include_prompt", True))


def _dense(folder: Path, path: str) -> Dense:
    config = _json(folder / path / "config.json") or {}
    activation = str(config.get("activation_function") or "torch.nn.modules.linear.Identity").rsplit(".", 1)[-1]
    if activation not in ACTIVATIONS:
        raise UnsupportedEncoder(f"{folder / path}: the Dense activation {activation!r} is not among {sorted(ACTIVATIONS)}")
    if config.get("module_input_name", "sentence_embedding") != "sentence_embedding":
        raise UnsupportedEncoder(f"{folder / path}: a Dense module on token embeddings is not run by this server")
    return Dense(path, int(config["in_features"]), int(config["out_features"]), bool(config.get("bias", True)),
                 ACTIVATIONS[activation])


def _type(module: dict) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None
