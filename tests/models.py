"""Models the tests make: a LoRA adapter of the bundled SmolLM2 made with peft that answers
differently by construction, and a small random Llama."""

from pathlib import Path
from typing import Any

from services.worker.engines.gguf import bundled_gguf_path


def steering_lora(folder: Path, *, messages: list[dict[str, str]], token: str, base: Path | None = None) -> Any:
    """Save a LoRA adapter of the bundled model in `folder` whose greedy answer to `messages` starts
    with `token` (one token of the tokenizer), so it answers differently from the base model by
    construction, not by chance (random weights could leave the answer as it was); returns the peft
    model it saved.

    Rank 1 on the last layer's `down_proj`: A reads the MLP activation `m` of the prompt's last
    position (A = m / |m|^2, so A.m = 1 there); B is the hidden state whose logits are closest to
    `token`'s alone (least squares over the output embeddings), divided by the final norm's weight
    and scaled to 20 times the hidden state's norm at that position. The first answer token is then
    `token`, ahead of the next by about 19 logits for the question of tests/e2e/test_lora_cpu_model.py
    (the base model's own choices are within 1 of each other). `base`: a model directory converted
    from the GGUF (`gguf.converted_model`: faster to load than the GGUF, the same weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf_path()
    source = (
        {"pretrained_model_name_or_path": str(base)}
        if base is not None
        else {
            "pretrained_model_name_or_path": str(gguf.parent),
            "gguf_file": gguf.name,
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(**source)
    model = AutoModelForCausalLM.from_pretrained(**source)
    (target,) = tokenizer.encode(token, add_special_tokens=False)
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    layers = model.model.layers
    seen: dict[str, Any] = {}
    hooks = [
        layers[-1].mlp.down_proj.register_forward_hook(lambda _m, inputs, _o: seen.update(m=inputs[0][0, -1])),
        layers[-1].register_forward_hook(
            lambda _m, _i, out: seen.update(h=(out[0] if isinstance(out, tuple) else out)[0, -1])
        ),
    ]
    with torch.no_grad():
        model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    activation, hidden = seen["m"].float(), seen["h"].float()
    # The final norm multiplies the hidden state by its weight (some of it negative): divided out here.
    weight = model.model.norm.weight.float()
    scale = torch.where(weight < 0, -1.0, 1.0) * weight.abs().clamp(min=0.1)
    embeddings = model.get_output_embeddings().weight.float()
    direction = torch.linalg.lstsq(embeddings, (torch.arange(len(embeddings)) == target).float()).solution / scale
    config = LoraConfig(r=1, lora_alpha=1, target_modules=["down_proj"], layers_to_transform=[len(layers) - 1])
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, weight in peft_model.named_parameters():
            if "lora_A" in name:
                weight.copy_((activation / activation.dot(activation)).unsqueeze(0))
            elif "lora_B" in name:
                weight.copy_((direction * (20 * hidden.norm() / direction.norm())).unsqueeze(1))
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
