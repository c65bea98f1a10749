"""LoRA adapters of the served llama-family model: loaded from peft's folders, held by name.

An adapter is peft's `save_pretrained` output (adapter_config.json, adapter_model.safetensors):
per layer and targeted projection, A [r, in] and B [out, r]; a targeted projection computes
x W^T + scale (x A^T) B^T, scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). The weights are
never merged into the model's: one step serves rows of several adapters and of the base model
(worker/model/lora_step.py adds each row's own delta). What the delta alone cannot express is refused
at load with a ValueError naming it (DoRA, biases, modules_to_save, embedding targets, ...).

`Adapters` is the worker's registry: at most `max_loras` loaded at once, each request holding
its adapter (acquire/release) from when the engine takes it in to its end, so an adapter in use is
never evicted; two loads under one name (revisions) are two adapters while requests hold each.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.model import quant_model
from worker.model.fused_layers import Weight

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The fused projections of worker/model/fused_layers.py and their parts, in the order their rows are concatenated.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
_BLOCK = {name: "mlp" if name.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn" for name in TARGETS}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")
# peft options whose adapters compute something other than x W^T + scale (x A^T) B^T, or whose
# per-module ranks and alphas this loader does not read: refused when set.
_UNSUPPORTED = ("use_dora", "use_qalora", "use_bdlora", "lora_bias", "fan_in_fan_out", "modules_to_save",
                "trainable_token_indices", "target_parameters", "layer_replication", "alora_invocation_tokens",
                "arrow_config", "kasa_config", "monteclora_config", "velora_config", "rank_pattern", "alpha_pattern")


@dataclass
class LoraAdapter:
    """One adapter's weights in the model's dtype and device, the scale folded into B."""

    name: str
    path: Path
    rank: int
    scale: float
    targets: frozenset[str]
    modules: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # per layer: module -> (A [r, in], scale B [out, r])
    fused: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # per layer: fused projection -> (A [R, in], B [out, R])
    root: int  # the prefix cache's chain root for its requests (worker/engine/block_manager.py), from its contents
    revision: int = 0  # the load it is (Adapters: 0 for a configured adapter)


def check_model(model: torch.nn.Module) -> None:
    """A ValueError where adapters cannot run on `model` (they do on llama-family layers only)."""
    kind = getattr(model.config, "model_type", None)
    if kind not in quant_model.LLAMA_FAMILY:
        raise ValueError(f"LoRA adapters run on llama-family models ({', '.join(sorted(quant_model.LLAMA_FAMILY))}); "
                         f"this worker serves model_type={kind!r}")


def load_adapter(name: str, path: str | Path, model: torch.nn.Module, max_rank: int) -> LoraAdapter:
    """The peft LoRA adapter in folder `path` for `model`; a ValueError naming what cannot be served."""
    from safetensors.torch import load_file

    check_model(model)
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"adapter {name!r}: {path} has no adapter_config.json and adapter_model.safetensors "
                         "(a peft save_pretrained folder)")
    raw_config, raw_weights = config_file.read_bytes(), weights_file.read_bytes()
    config = json.loads(raw_config)
    _check_config(name, config, max_rank)
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    layers = model.model.layers
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    found: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in layers]
    for key, tensor in load_file(weights_file).items():
        match = _KEY.match(key)
        if match is None:
            what = "an embedding target" if "embedding" in key or "embed_tokens" in key else "not a LoRA A or B"
            raise ValueError(f"adapter {name!r}: tensor {key!r} is {what}; only {', '.join(TARGETS)} are served")
        layer, block, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in TARGETS or block != _BLOCK[module]:
            raise ValueError(f"adapter {name!r}: target module {block}.{module} is not served; "
                             f"targets may be {', '.join(TARGETS)}")
        if layer >= len(layers):
            raise ValueError(f"adapter {name!r}: layer {layer} beyond the model's {len(layers)} layers")
        found[layer].setdefault(module, {})[which] = tensor
    modules: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for i, parts in enumerate(found):
        modules.append({})
        for module, ab in parts.items():
            target = getattr(getattr(layers[i], _BLOCK[module]), module, None)
            if target is None:
                raise ValueError(f"adapter {name!r}: the model's layers have no {module}")
            a, b = ab.get("A"), ab.get("B")
            want_a, want_b = (rank, target.in_features), (target.out_features, rank)
            if a is None or b is None or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                got = [None if t is None else tuple(t.shape) for t in (a, b)]
                raise ValueError(f"adapter {name!r}: layer {i} {module}'s A and B are {got}; the model needs "
                                 f"{want_a} and {want_b} (r={rank}): an adapter of another model?")
            modules[i][module] = (a.to(device, dtype), (b.float() * scale).to(device, dtype))
    targets = frozenset(m for layer in modules for m in layer)
    if not targets:
        raise ValueError(f"adapter {name!r}: {weights_file} holds no LoRA weights")
    root = int.from_bytes(hashlib.blake2b(b"lora\0" + raw_config + raw_weights, digest_size=16).digest(), "little")
    fused = [_fuse(layer, parts) for layer, parts in zip(layers, modules)]
    return LoraAdapter(name, path, rank, scale, targets, modules, fused, root)


def _check_config(name: str, config: dict, max_rank: int) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type={config.get('peft_type')!r}; only LORA is served")
    for option in _UNSUPPORTED:
        if config.get(option):
            raise ValueError(f"adapter {name!r}: {option}={config[option]!r} is not served (plain LoRA only)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: bias={config['bias']!r} is not served (only bias='none')")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1 or "lora_alpha" not in config:
        raise ValueError(f"adapter {name!r}: adapter_config.json needs an integer r >= 1 and lora_alpha")
    if rank > max_rank:
        raise ValueError(f"adapter {name!r}: rank r={rank} is over max_lora_rank={max_rank}")


def _fuse(layer: torch.nn.Module, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Each fused projection's delta as one low-rank pair: the targeted parts' A stacked, their B
    placed block-diagonally at the part's output rows (zero rows for a part not targeted)."""
    fused = {}
    for projection, names in FUSED.items():
        if not any(n in parts for n in names):
            continue
        sizes = [getattr(getattr(layer, _BLOCK[n]), n).out_features for n in names]
        held = [parts[n] for n in names if n in parts]
        a = torch.cat([a for a, _ in held])
        b = a.new_zeros((sum(sizes), a.shape[0]))
        row = col = 0
        for n, size in zip(names, sizes):
            if n in parts:
                part = parts[n][1]
                b[row:row + size, col:col + part.shape[1]] = part
                col += part.shape[1]
            row += size
        fused[projection] = (a, b)
    return fused


STACKS = 4  # sets of adapters whose stacked deltas Adapters keeps
Key = tuple[str, int]  # an adapter's name and the revision of its load (0: configured, or before revisions)


class Adapters:
    """The worker's LoRA adapters: (name, revision) -> LoraAdapter, at most `max_loras` loaded at
    once. `configured`: name -> folder (STREAMQ_LORA_MODULES), loaded on a request's first use when
    not loaded already; an adapter loaded at run time comes with its request's revision and folder
    (RequestPayload.adapter_revision), so a load under its name since runs the new weights while
    the requests holding the old ones end on them. Used from the model thread; names() and
    servable() may be read from any thread."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int,
                 known: dict[str, Path] | None = None, tile: int = 0, kernels=None):
        """`tile`: each delta's matmuls in calls of exactly this many rows (0: any number), as
        deterministic mode runs the library's matmuls (worker/model/fused_layers.py Weight._tiled);
        `kernels`: the runner's CPU step kernels, whose panel_linear runs the stacked deltas."""
        check_model(model)
        self.kernels = kernels
        self.model, self.max_loras, self.max_rank, self.tile = model, max_loras, max_rank, tile
        self.configured = dict(known or {})  # STREAMQ_LORA_MODULES: always served
        self.known = dict(self.configured)  # and those loaded at run time (learn): name -> folder
        self._loaded: OrderedDict[Key, LoraAdapter] = OrderedDict()  # least recently acquired first
        self._holders: dict[str, Key] = {}  # holder (a request id) -> the adapter it holds
        self._stacks: OrderedDict[tuple[Key, ...], list[dict]] = OrderedDict()  # stacked(): the last few sets

    def names(self) -> list[str]:
        return sorted({name for name, _ in list(self._loaded)})  # list(): one copy, taken whole

    def servable(self) -> list[str]:
        """Every adapter this worker serves: configured, or loaded at run time (learn)."""
        return sorted(self.known)

    def learn(self, runtime: dict[str, Path]) -> None:
        """The adapters loaded at run time (shared/lora_registry.py), read at each heartbeat on the
        event loop, for the heartbeat's list: one name -> folder map swapped in whole. A configured
        adapter keeps its own folder."""
        self.known = {**runtime, **self.configured}

    def get(self, key: Key) -> LoraAdapter:
        return self._loaded[key]

    def stacked(self, keys: tuple[Key, ...]) -> list[dict[str, tuple[Weight, Weight, torch.Tensor]]]:
        """Per layer, each fused projection's deltas of adapters `keys` side by side, as Weights (on
        the kernels' panels where they run: a small matmul through the library cost 25-35 us a call
        here, most of it overhead): (A [sum R, in], B [out, sum R], the index in `keys` of each of the
        sum R columns). Kept for the last
        STACKS sets of keys a step held (a batch keeps its set for many steps)."""
        stack = self._stacks.get(keys)
        if stack is None:
            held = [self._loaded[k] for k in keys]
            stack, owners = [], {}  # owners: one tensor per column layout, shared by the layers alike
            for i in range(len(self.model.model.layers)):
                layer = {}
                for projection in FUSED:
                    parts = [(j, a.fused[i][projection]) for j, a in enumerate(held) if projection in a.fused[i]]
                    if parts:
                        widths = tuple((j, a.shape[0]) for j, (a, _) in parts)
                        if widths not in owners:
                            owners[widths] = torch.cat([torch.full((w,), j) for j, w in widths]).to(parts[0][1][0].device)
                        owner = owners[widths]
                        a = torch.cat([a for _, (a, _) in parts])
                        b = torch.cat([b for _, (_, b) in parts], dim=1).contiguous()
                        layer[projection] = (Weight(a, None, a.device, self.kernels),
                                             Weight(b, None, b.device, self.kernels), owner)
                stack.append(layer)
            self._stacks[keys] = stack
            while len(self._stacks) > STACKS:
                self._stacks.popitem(last=False)
        return stack

    def load(self, name: str, path: str | Path, revision: int = 0) -> LoraAdapter:
        """Load (or reload) revision `revision` of adapter `name` from `path`; an idle adapter is
        unloaded to make room where max_loras are loaded, and the earlier revisions of `name` no
        request holds are dropped (never run again). A ValueError where it cannot be served or there
        is no room."""
        key = (name, revision)
        if key in self._loaded and self._in_use(key):
            raise ValueError(f"adapter {name!r} is in use by running requests: it cannot be reloaded now")
        adapter = load_adapter(name, path, self.model, self.max_rank)
        adapter.revision = revision
        self._loaded.pop(key, None)
        for old in [k for k in self._loaded if k[0] == name and k[1] < revision and not self._in_use(k)]:
            del self._loaded[old]
        if len(self._loaded) >= self.max_loras:
            idle = next((k for k in self._loaded if not self._in_use(k)), None)
            if idle is None:
                raise ValueError(f"adapter {name!r}: max_loras={self.max_loras} adapters are loaded and all in use")
            del self._loaded[idle]
        self._loaded[key] = adapter
        self._stacks.clear()
        return adapter

    def unload(self, name: str) -> None:
        keys = [k for k in self._loaded if k[0] == name]
        if any(self._in_use(k) for k in keys):
            raise ValueError(f"adapter {name!r} is in use by running requests: it cannot be unloaded now")
        for key in keys:
            del self._loaded[key]
        self._stacks.clear()

    def acquire(self, name: str, holder: str, revision: int | None = None, path: str | Path | None = None) -> LoraAdapter:
        """Adapter `name` for request `holder`, loaded if need be; it stays loaded until released.
        A configured adapter runs on its own folder; one loaded at run time on `path`, the folder of
        its load `revision` (shared/lora_registry.py). A ValueError naming the adapter where it is
        unknown or cannot load."""
        if name in self.configured:
            key, folder = (name, 0), self.configured[name]
        elif revision is not None and path is not None:
            key, folder = (name, revision), Path(path)
        else:  # only one loaded by hand (load) runs
            key, folder = (name, 0), None
        adapter = self._loaded.get(key)
        if adapter is None:
            if folder is None:
                served = ", ".join(sorted(self.configured)) or "none"
                raise ValueError(f"adapter {name!r} is not loaded on this worker and no folder is known for it "
                                 f"(STREAMQ_LORA_MODULES, or /v1/load_lora_adapter; configured: {served})")
            adapter = self.load(name, folder, key[1])
        self._loaded.move_to_end(key)
        self._holders[holder] = key
        return adapter

    def release(self, holder: str) -> None:
        """`holder` ends: its adapter stays loaded, unless a later revision of it is loaded and no
        other request holds this one (it would never run again)."""
        key = self._holders.pop(holder, None)
        if key is None or self._in_use(key):
            return
        if any(k[0] == key[0] and k[1] > key[1] for k in self._loaded):
            self._loaded.pop(key, None)
            self._stacks.clear()

    def _in_use(self, key: Key) -> bool:
        return key in self._holders.values()
