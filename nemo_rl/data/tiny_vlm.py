"""A tiny Qwen2.5-VL, built here and deterministically: transformers' own ``Qwen2_5_VLForConditionalGeneration``
and ``Qwen2_5_VLProcessor``, so the checkpoint loads, trains and exports like a hub one, with no conversion.

- The tokenizer is the character-level one of :mod:`nemo_rl.data.tiny` plus the four special tokens the
  Qwen2.5-VL processor and model read (``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
  ``<|video_pad|>``). Its chat template renders an image part of a message as
  ``<|vision_start|><|image_pad|><|vision_end|>``; the processor then repeats ``<|image_pad|>`` once per
  merged patch of the image (``grid_t * grid_h * grid_w / merge_size**2``), as it does for Qwen's own template.
- The image processor keeps images between :data:`TINY_VLM_MIN_PIXELS` and :data:`TINY_VLM_MAX_PIXELS`
  (56x56 to 112x112): an image costs 4 to 16 tokens and a forward of the vision tower a few milliseconds.
- The vision tower has 2 blocks of width 64 (patch 14, temporal patch 2, spatial merge 2); its merger (the
  projection) maps into the 128-wide, 2-layer language model, whose embeddings are tied to its head.

Build it with ``python -m nemo_rl.data.tiny_vlm OUT_DIR`` (``examples/assets/tiny_qwen25vl_init`` is that
folder for seed 0). :func:`build_tiny_qwen2_vl` (``--family qwen2_vl``) builds the same model in the Qwen2-VL
family, for the tests of the second family.
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nemo_rl.data import tiny

if TYPE_CHECKING:
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"
VISION_TOKENS = (VISION_START_TOKEN, VISION_END_TOKEN, IMAGE_PAD_TOKEN, VIDEO_PAD_TOKEN)

TINY_VLM_MIN_PIXELS = 56 * 56
"""Smallest image area the tiny processor resizes to (4 x 4 patches of 14 pixels: 4 image tokens)."""

TINY_VLM_MAX_PIXELS = 112 * 112
"""Largest image area the tiny processor resizes to (8 x 8 patches: 16 image tokens)."""

TINY_VLM_MAX_POSITIONS = 512

_IMAGE_PART = VISION_START_TOKEN + IMAGE_PAD_TOKEN + VISION_END_TOKEN
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + _IMAGE_PART + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)
TINY_VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}" + tiny.SYSTEM_TOKEN + _CONTENT + ""
    "{% elif message['role'] == 'user' %}" + tiny.USER_TOKEN + _CONTENT + ""
    "{% elif message['role'] == 'assistant' %}" + tiny.ASSISTANT_TOKEN + _CONTENT + tiny.EOS_TOKEN + ""
    "{% else %}{{ raise_exception('the tiny VLM chat template has no role ' + message['role']) }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + tiny.ASSISTANT_TOKEN + "{% endif %}"
)
"""The tiny template of :mod:`nemo_rl.data.tiny` with message contents that may be lists of ``{"type": "text",
"text": ...}`` and ``{"type": "image", "image": ...}`` parts (OpenAI / Hugging Face multimodal messages)."""


def build_tiny_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer with the vision special tokens and the multimodal chat template."""
    specials = (*tiny.SPECIAL_TOKENS, *VISION_TOKENS)
    vocab = {token: i for i, token in enumerate((*specials, *tiny.CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=tiny.UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=tiny.PAD_TOKEN,
        bos_token=tiny.BOS_TOKEN,
        eos_token=tiny.EOS_TOKEN,
        unk_token=tiny.UNK_TOKEN,
        additional_special_tokens=[tiny.USER_TOKEN, tiny.ASSISTANT_TOKEN, tiny.SYSTEM_TOKEN, *VISION_TOKENS],
        model_max_length=TINY_VLM_MAX_POSITIONS,
        chat_template=TINY_VLM_CHAT_TEMPLATE,
    )


def build_tiny_vlm_processor() -> Qwen2_5_VLProcessor:
    """Qwen2.5-VL's own processor around the tiny tokenizer, resizing images to 56x56 ... 112x112 pixels."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    pixels = {"min_pixels": TINY_VLM_MIN_PIXELS, "max_pixels": TINY_VLM_MAX_PIXELS}
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2, **pixels),
        tokenizer=build_tiny_vlm_tokenizer(),
        video_processor=Qwen2VLVideoProcessor(**pixels),
        chat_template=TINY_VLM_CHAT_TEMPLATE,
    )


def tiny_vlm_config(tokenizer: PreTrainedTokenizerFast) -> Any:
    """The ``Qwen2_5_VLConfig`` of the tiny model for ``tokenizer`` (see the module docstring)."""
    from transformers import Qwen2_5_VLConfig

    ids = tiny.tiny_token_ids(tokenizer)
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": tiny.TINY_HIDDEN_SIZE,
        "num_hidden_layers": 2,
        "num_attention_heads": tiny.TINY_NUM_HEADS,
        "num_key_value_heads": tiny.TINY_NUM_KV_HEADS,
        "intermediate_size": 256,
        "max_position_embeddings": TINY_VLM_MAX_POSITIONS,
        # Multimodal RoPE: the 16 rotary frequency pairs of a 32-wide head split over (time, height, width).
        "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0},
        **ids,
    }
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "num_heads": 2,
        "intermediate_size": 128,
        "out_hidden_size": tiny.TINY_HIDDEN_SIZE,
        "fullatt_block_indexes": [1],
        "window_size": 56,
    }
    vocab = tokenizer.get_vocab()
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=vocab[IMAGE_PAD_TOKEN],
        video_token_id=vocab[VIDEO_PAD_TOKEN],
        vision_start_token_id=vocab[VISION_START_TOKEN],
        vision_end_token_id=vocab[VISION_END_TOKEN],
        tie_word_embeddings=True,
        dtype="float32",
        **ids,
    )


def build_tiny_vlm(path: str | pathlib.Path, seed: int) -> Qwen2_5_VLForConditionalGeneration:
    """Build the randomly initialised tiny Qwen2.5-VL (~0.57M parameters), save it with its processor
    (tokenizer, image and video processors, chat template) under ``path`` and return it.

    The same ``seed`` gives the same weights; the global torch RNG is left untouched.
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    processor = build_tiny_vlm_processor()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(tiny_vlm_config(processor.tokenizer))
    tiny.save_tiny_model(model, processor.tokenizer, path)
    processor.save_pretrained(str(path))
    return model


def build_tiny_qwen2_vl(path: str | pathlib.Path, seed: int) -> Any:
    """The same tiny model in the Qwen2-VL family (the second family built here): the language model and
    tokenizer of :func:`build_tiny_vlm`, Qwen2-VL's vision tower (2 LayerNorm blocks of width 64, no window
    attention) and ``Qwen2VLProcessor``; saved under ``path`` and returned. Used by the tests."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    qwen25 = build_tiny_vlm_processor()
    processor = Qwen2VLProcessor(
        image_processor=qwen25.image_processor,
        tokenizer=qwen25.tokenizer,
        video_processor=qwen25.video_processor,
        chat_template=TINY_VLM_CHAT_TEMPLATE,
    )
    reference = tiny_vlm_config(processor.tokenizer)
    text = {
        k: v for k, v in reference.text_config.to_dict().items() if k not in ("model_type", "architectures")
    }
    vision = {
        "depth": 2,
        "embed_dim": 64,
        "hidden_size": tiny.TINY_HIDDEN_SIZE,
        "num_heads": 2,
        "mlp_ratio": 2,
    }
    tokens = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,
        **{name: getattr(reference, name) for name in tokens},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    tiny.save_tiny_model(model, processor.tokenizer, path)
    processor.save_pretrained(str(path))
    return model


def main(argv: Sequence[str] | None = None) -> None:
    """Build the tiny Qwen2.5-VL (or with ``--family qwen2_vl`` the tiny Qwen2-VL) under ``OUT_DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--seed", type=int, default=0, help="seed of the model weights")
    parser.add_argument("--family", choices=("qwen2_5_vl", "qwen2_vl"), default="qwen2_5_vl")
    args = parser.parse_args(argv)
    build = build_tiny_vlm if args.family == "qwen2_5_vl" else build_tiny_qwen2_vl
    model = build(args.out_dir, seed=args.seed)
    print(f"tiny {args.family} ({model.num_parameters()} parameters): {args.out_dir}")


if __name__ == "__main__":
    main()
