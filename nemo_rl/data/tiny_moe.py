"""Tiny mixture-of-experts checkpoints for tests and CPU runs, built like the dense tiny model.

Two families, each with the character-level tokenizer of :mod:`nemo_rl.data.tiny`, hidden size 128, 2
layers, 4 attention heads (2 KV heads), 8 routed experts of width 64, top-2 routing, tied embeddings:

- ``qwen3_moe``: softmax router, normalised top-2 probabilities, no shared expert, every layer MoE.
- ``glm4_moe``: transformers' GLM-4-MoE, which is DeepSeek-V3's MoE layer (sigmoid router with a score
  correction bias, 2 expert groups of which 1 is kept, ``routed_scaling_factor`` 2.5, one shared expert,
  the first layer dense) on grouped-query attention. DeepSeek-V3 itself also needs multi-head latent
  attention, which nemo_rl's own decoder does not implement.

Build them with ``python -m nemo_rl.data.tiny_moe OUT_DIR`` (or see examples/assets/README.md).
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerFast

from nemo_rl.data.tiny import (
    TINY_HIDDEN_SIZE,
    TINY_MAX_POSITION_EMBEDDINGS,
    TINY_NUM_HEADS,
    TINY_NUM_KV_HEADS,
    build_tiny_tokenizer,
    save_tiny_model,
    tiny_token_ids,
)

MoeFamily = Literal["qwen3_moe", "glm4_moe"]
MOE_FAMILIES: tuple[MoeFamily, ...] = ("qwen3_moe", "glm4_moe")

TINY_MOE_NUM_LAYERS = 2
TINY_MOE_NUM_EXPERTS = 8
TINY_MOE_TOP_K = 2
TINY_MOE_EXPERT_SIZE = 64
TINY_MOE_DENSE_SIZE = 256
"""Width of the GLM-4-MoE model's dense first layer."""


def _config(family: MoeFamily, tokenizer: PreTrainedTokenizerFast) -> Any:
    from transformers import Glm4MoeConfig, Qwen3MoeConfig

    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": TINY_HIDDEN_SIZE,
        "num_hidden_layers": TINY_MOE_NUM_LAYERS,
        "num_attention_heads": TINY_NUM_HEADS,
        "num_key_value_heads": TINY_NUM_KV_HEADS,
        "head_dim": TINY_HIDDEN_SIZE // TINY_NUM_HEADS,
        "num_experts_per_tok": TINY_MOE_TOP_K,
        "moe_intermediate_size": TINY_MOE_EXPERT_SIZE,
        "intermediate_size": TINY_MOE_DENSE_SIZE,
        "max_position_embeddings": TINY_MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": True,
        "dtype": "float32",
        **tiny_token_ids(tokenizer),
    }
    if family == "qwen3_moe":
        return Qwen3MoeConfig(num_experts=TINY_MOE_NUM_EXPERTS, norm_topk_prob=True, **common)
    # Full rotary embeddings (GLM's default rotates half of each head, which nemo_rl's decoder does not); the
    # config takes this keyword through **kwargs.
    full_rotary: dict[str, Any] = {"partial_rotary_factor": 1.0}
    return Glm4MoeConfig(
        n_routed_experts=TINY_MOE_NUM_EXPERTS,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        attention_bias=True,
        **common,
        **full_rotary,
    )


def build_tiny_moe_model(
    family: MoeFamily, path: str | pathlib.Path, tokenizer_path: str | pathlib.Path, seed: int
) -> Any:
    """Build a randomly initialised tiny MoE causal LM of ``family``, save it with the tokenizer at
    ``tokenizer_path`` under ``path`` and return it. The same ``seed`` gives the same weights; the global
    torch RNG is left untouched."""
    from transformers import AutoModelForCausalLM

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_path))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_config(family, tokenizer))
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                # A fresh correction bias is zero, which would leave the biased expert choice untested; a
                # trained model's is not.
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.05)
    save_tiny_model(model, tokenizer, path)
    return model


def main(argv: Sequence[str] | None = None) -> None:
    """Build ``OUT/tiny_<family>_init`` for every family (tokenizer under ``OUT/tokenizer``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--seed", type=int, default=0, help="seed of the model weights")
    args = parser.parse_args(argv)
    build_tiny_tokenizer(args.out_dir / "tokenizer")
    for family in MOE_FAMILIES:
        path = args.out_dir / f"tiny_{family}_init"
        model = build_tiny_moe_model(family, path, args.out_dir / "tokenizer", seed=args.seed)
        print(f"{family} ({model.num_parameters()} parameters): {path}")


if __name__ == "__main__":
    main()
