"""LoRA adapters (worker/model/lora.py, worker/model/lora_step.py): loading, refusals, the registry, each
row's gathered delta against a per-row reference, and the prefix cache's chain roots."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.settings import WorkerSettings, parse_lora_modules
from streamq.testing.lora_adapters import ALL, make_adapter
from worker.engine.block_manager import BlockManager, block_hash
from worker.model.fused_layers import fuse
from worker.model.lora import Adapters, load_adapter
from worker.model.lora_step import StepLora, add_deltas
from worker.model.model_loader import load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(tiny_llama, CPU, torch.float32)


def test_an_adapter_loads_with_its_rank_scale_targets_and_weights(tiny_llama, model, tmp_path):
    path = make_adapter(tiny_llama, tmp_path / "a", r=4, alpha=8, modules=["q_proj", "v_proj", "down_proj"])
    adapter = load_adapter("a", path, model, max_rank=16)
    assert (adapter.rank, adapter.scale, adapter.targets) == (4, 2.0, {"q_proj", "v_proj", "down_proj"})
    saved = load_file(path / "adapter_model.safetensors")
    a, b = adapter.modules[1]["v_proj"]
    assert torch.equal(a, saved["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"])
    assert torch.allclose(b, 2.0 * saved["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"])
    assert set(adapter.fused[0]) == {"qkv", "down"}
    rs = load_adapter("rs", make_adapter(tiny_llama, tmp_path / "rs", r=4, alpha=8, use_rslora=True), model, 16)
    assert rs.scale == 8 / math.sqrt(4)


@pytest.mark.parametrize("options, match", [
    ({"use_dora": True}, "use_dora"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"modules": ["embed_tokens"]}, "embedding"),
    ({"modules": ["lm_head"]}, "lm_head"),
    ({"r": 32}, "rank r=32 is over max_lora_rank=16"),
])
def test_what_the_runner_cannot_serve_is_refused_by_name(tiny_llama, model, tmp_path, options, match):
    path = make_adapter(tiny_llama, tmp_path / "x", **options)
    with pytest.raises(ValueError, match=match):
        load_adapter("x", path, model, max_rank=16)


def test_an_adapter_of_another_shape_is_refused(tiny_llama, model, tmp_path):
    path = make_adapter(tiny_llama, tmp_path / "x", r=4, modules=["k_proj"])
    weights = load_file(path / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    weights[key] = torch.zeros(48, 4)
    save_file(weights, path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="layer 0 k_proj's A and B"):
        load_adapter("x", path, model, max_rank=16)


def test_adapters_are_refused_on_other_architectures(tiny_opt, tmp_path):
    with pytest.raises(ValueError, match="model_type='opt'"):
        Adapters(load_model(tiny_opt, CPU, torch.float32), 2, 16)


def test_the_registry_loads_known_adapters_on_use_and_keeps_those_in_use(tiny_llama, model, tmp_path):
    paths = {name: make_adapter(tiny_llama, tmp_path / name, seed=i) for i, name in enumerate("abc")}
    adapters = Adapters(model, 2, 16, known=paths)
    assert adapters.acquire("a", "r1").name == "a" and adapters.acquire("b", "r2").name == "b"
    with pytest.raises(ValueError, match="max_loras=2 adapters are loaded and all in use"):
        adapters.acquire("c", "r3")
    with pytest.raises(ValueError, match="'b' is in use"):
        adapters.unload("b")
    adapters.release("r1")
    adapters.acquire("c", "r3")  # a was idle: unloaded for c
    assert adapters.names() == ["b", "c"]
    with pytest.raises(ValueError, match="adapter 'nope' is not loaded on this worker"):
        adapters.acquire("nope", "r4")


def test_a_load_under_a_loaded_name_runs_beside_the_one_still_held_which_goes_once_released(
        tiny_llama, model, tmp_path):
    first, second = (make_adapter(tiny_llama, tmp_path / name, seed=i) for i, name in enumerate("ab"))
    adapters = Adapters(model, 4, 16)
    old = adapters.acquire("x", "r1", 1, first)
    new = adapters.acquire("x", "r2", 2, second)  # loaded again while r1 runs: r2 gets the new weights
    assert (old.revision, new.revision) == (1, 2) and old.root != new.root
    assert new.root == load_adapter("x", second, model, 16).root and adapters.names() == ["x"]
    chunks = [SimpleNamespace(seq=SimpleNamespace(adapter="x", adapter_revision=r), length=2) for r in (1, 2)]
    assert [adapter for adapter, _ in StepLora.of(chunks, adapters, CPU).groups] == [old, new]
    adapters.release("r1")  # the old load runs no more: gone
    assert adapters.get(("x", 2)) is new
    with pytest.raises(KeyError):
        adapters.get(("x", 1))
    adapters.release("r2")
    third = adapters.acquire("x", "r3", 3, first)  # an idle earlier load goes when a later one loads
    assert adapters.get(("x", 3)) is third
    with pytest.raises(KeyError):
        adapters.get(("x", 2))
    with pytest.raises(ValueError, match="adapter 'y' is not loaded on this worker"):
        adapters.acquire("y", "r4")  # run-time adapters come with their load (RequestPayload.adapter_revision)


def test_each_row_gets_its_own_adapters_delta_and_a_base_row_none(tiny_llama, model, tmp_path):
    adapters = Adapters(model, 4, 16)
    one = adapters.load("one", make_adapter(tiny_llama, tmp_path / "one", r=4, modules=["q_proj", "v_proj"], seed=1))
    two = adapters.load("two", make_adapter(tiny_llama, tmp_path / "two", r=8, seed=2))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen)
    rows = {"one": [0, 3, 4], "two": [1, 6]}  # 2 and 5: the base model
    step = StepLora([(one, torch.tensor(rows["one"])), (two, torch.tensor(rows["two"]))])
    base = torch.randn(7, 64 + 32 + 32, generator=gen)
    got = add_deltas(base.clone(), x, [(r, *a.fused[0]["qkv"]) for a, r in step.groups])
    want = base.clone()
    for adapter in (one, two):
        for row in rows[adapter.name]:
            parts = []
            for name, size in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
                pair = adapter.modules[0].get(name)
                parts.append(torch.zeros(size) if pair is None else x[row] @ pair[0].T @ pair[1].T)
            want[row] += torch.cat(parts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[[2, 5]], base[[2, 5]])  # base rows: the base projection's bits


def test_the_fused_layers_of_a_step_add_the_deltas_the_modules_do(tiny_llama, model, tmp_path):
    adapters = Adapters(model, 4, 16)
    adapter = adapters.load("all", make_adapter(tiny_llama, tmp_path / "all", r=4, seed=3))
    fused = fuse(load_model(tiny_llama, CPU, torch.float32), CPU)
    step = StepLora([(adapter, torch.tensor([1, 2]))])
    layer, plain = step.layers(fused)[0], fused[0]
    x = torch.randn(3, 64)
    mlp_in = torch.randn(3, 128)
    attn = model.model.layers[0].self_attn
    want = torch.cat([step.project(0, n, getattr(attn, n), x) for n in ("q_proj", "k_proj", "v_proj")], dim=-1)
    torch.testing.assert_close(layer.qkv(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.down(mlp_in), step.project(0, "down_proj", model.model.layers[0].mlp.down_proj,
                                                                 mlp_in), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.qkv(x)[0], plain.qkv(x)[0])


def test_the_same_tokens_under_another_adapter_hash_apart_and_the_base_as_before(tiny_llama, model, tmp_path):
    adapter = load_adapter("a", make_adapter(tiny_llama, tmp_path / "a", seed=1), model, 16)
    tokens = list(range(1, 10))
    blocks = BlockManager(16, 4)
    blocks.allocate_prefix("base", tokens)
    blocks.append_slots("base", 9)
    blocks.register("base", tokens, 8)
    assert blocks.blocks[blocks.table("base")[0]].hash == block_hash(None, (1, 2, 3, 4))  # today's hash
    assert blocks.allocate_prefix("lora", tokens, adapter.root) == 0  # none of the base's blocks
    blocks.append_slots("lora", 9)
    blocks.register("lora", tokens, 8)
    assert blocks.blocks[blocks.table("lora")[0]].hash == block_hash(adapter.root, (1, 2, 3, 4))
    assert blocks.allocate_prefix("lora2", tokens, adapter.root) == 8  # its own adapter's blocks are shared
    assert [link.parent for link in blocks.missing_prefix(list(range(20, 30)), adapter.root)][:1] == [adapter.root]


def test_lora_modules_parse_and_refuse_what_is_not_name_path(monkeypatch):
    assert parse_lora_modules(" sql=/a/b , chat=/c ") == {"sql": Path("/a/b"), "chat": Path("/c")}
    monkeypatch.setenv("STREAMQ_LORA_MODULES", "sql=/a,sql=/b")
    with pytest.raises(ValueError, match="names adapter 'sql' twice"):
        WorkerSettings()
    monkeypatch.setenv("STREAMQ_LORA_MODULES", "sql")
    with pytest.raises(ValueError, match="'sql' is not name=path"):
        WorkerSettings()
    monkeypatch.setenv("STREAMQ_LORA_MODULES", "sql=/a")
    monkeypatch.setenv("STREAMQ_BACKEND", "vllm")  # vLLM's own LoRA serves them
    assert WorkerSettings().lora.paths == {"sql": Path("/a")}
    monkeypatch.setenv("STREAMQ_BACKEND", "null")
    with pytest.raises(ValueError, match="not by the null backend"):
        WorkerSettings()
    monkeypatch.delenv("STREAMQ_LORA_MODULES")
    monkeypatch.setenv("STREAMQ_ENABLE_LORA", "true")
    with pytest.raises(ValueError, match="not by the null backend"):
        WorkerSettings()


def test_the_config_says_what_is_refused(tiny_llama, model, tmp_path):
    path = make_adapter(tiny_llama, tmp_path / "x", modules=ALL)
    config = json.loads((path / "adapter_config.json").read_text())
    config["peft_type"] = "IA3"
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="peft_type='IA3'"):
        load_adapter("x", path, model, 16)


def test_a_small_step_stacks_its_adapters_and_adds_what_the_gathered_products_do(tiny_llama, model, tmp_path):
    adapters = Adapters(model, 4, 16)
    for i, (name, targets) in enumerate((("one", ["q_proj", "up_proj"]), ("two", None))):
        adapters.load(name, make_adapter(tiny_llama, tmp_path / name, r=4 * (i + 1), modules=targets, seed=i))
    chunks = [SimpleNamespace(seq=SimpleNamespace(adapter=name, adapter_revision=0), length=n)
              for name, n in (("two", 3), (None, 1), ("one", 2), ("two", 1))]
    stacked = StepLora.of(chunks, adapters, CPU)
    assert stacked.stack is not None and stacked.owner.tolist() == [1, 1, 1, -1, 0, 0, 1]
    gathered = StepLora(stacked.groups)
    fused = fuse(load_model(tiny_llama, CPU, torch.float32), CPU)
    x = torch.randn(7, 64)
    for got, want, plain in zip(stacked.layers(fused), gathered.layers(fused), fused):
        for projection in ("qkv", "o", "gate_up"):
            torch.testing.assert_close(getattr(got, projection)(x), getattr(want, projection)(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(got.qkv(x)[3], plain.qkv(x)[3])  # the base row: the base projection's bits
