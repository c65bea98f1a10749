"""LoRA adapters made by peft on a model folder, with random non-zero A and B (an untrained
adapter from peft's init has B = 0, which would change nothing), for the tests and benchmarks."""
from __future__ import annotations

from pathlib import Path

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_folder: Path, target: Path, r: int = 4, alpha: float = 8.0, modules: list[str] | None = None,
                 seed: int = 0, magnitude: float = 0.5, **options) -> Path:
    """A peft LoRA adapter of the model in `model_folder`, saved to `target`: rank r on `modules`
    (default all seven projections), weights drawn from `seed` and scaled so the adapter moves the
    greedy tokens; `options` go to LoraConfig (use_rslora, use_dora, bias, modules_to_save, ...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=modules or ALL, init_lora_weights=False, **options)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * magnitude / param.shape[-1] ** 0.5)
    peft_model.save_pretrained(target)
    return target


def merged_greedy(model_folder: Path, adapter: Path | None, prompt: list[int], new_tokens: int) -> list[int]:
    """peft's merged model's greedy tokens after `prompt` (the base model's where `adapter` is None)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.generation_config.eos_token_id = None  # as the engine with ignore_eos: EOS is a token like any
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()
