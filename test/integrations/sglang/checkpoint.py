"""A tiny random FLUX.2 klein checkpoint in diffusers' folder layout, made offline, for sglang's own
pipeline (which loads its models from such a folder): a byte-level BPE tokenizer trained here on a few
sentences with a Qwen-style chat template, a Qwen3 text encoder of 28 narrow layers (klein reads the
hidden states of layers 9, 18 and 27), a FLUX.2 transformer with every weight drawn (no zero-initialised
layer), a small AutoencoderKLFlux2 with random batch-norm statistics, and klein's scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TEXT_HIDDEN = 32
# sglang picks FLUX.2 klein's pipeline configuration by this part of the folder's name.
FOLDER = "flux2-klein-tiny"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["a photo of a cat sitting on a red chair", "watercolor mountains at sunrise", "user assistant"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus * 20, trainer)
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_checkpoint(parent: Path, seed: int = 0) -> Path:
    """Write the checkpoint into `parent`/FOLDER and return that folder."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=28,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_HIDDEN,
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(8, 8, 8, 8),
        rope_theta=2000,
        guidance_embeds=False,
    )
    vae = AutoencoderKLFlux2(
        block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_num_groups=8, latent_channels=32
    )
    with torch.no_grad():
        for weight in transformer.parameters():
            weight.normal_(0, 0.05)
        vae.bn.running_mean.normal_(0, 0.1)
        vae.bn.running_var.uniform_(0.5, 1.5)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )
    pipeline = Flux2KleinPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=True,
    )
    folder = parent / FOLDER
    pipeline.save_pretrained(folder)
    return folder
