"""Models the tests make: the bundled SmolLM2 converted for vLLM once per run, and a random LoRA
adapter of it made with peft."""

from pathlib import Path
from typing import Any

from services.worker.engines.gguf import bundled_gguf_path


def random_lora(folder: Path, *, seed: int = 0, base: Path | None = None) -> Any:
    """Save a tiny LoRA adapter of the bundled model in `folder` (rank 4 on q_proj and v_proj, a
    random non-zero B, so it changes the answers); returns the peft model it saved. `base`: the
    model directory converted for vLLM (faster to load than the GGUF, the same weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base)
    else:
        gguf = bundled_gguf_path()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: the adapter would change nothing
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.4)
    peft_model.save_pretrained(folder, save_embedding_layers=False)
    return peft_model


def random_llama(folder: Path, *, seed: int = 0) -> Path:
    """Save a small Llama with random weights (float32, 8 attention heads and 4 KV heads, so tensor
    parallelism can split them in 2 or 4) and the bundled model's tokenizer and chat template in
    `folder`; returns `folder`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = bundled_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
