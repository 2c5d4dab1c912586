"""Image prompts for the generation tests of vision-language models (embedded engine and vLLM), and
transformers' ``generate`` as the reference.

The model is the tiny Qwen2.5-VL of :mod:`nemo_rl.data.tiny_vlm` with its weights redrawn larger than the
default initialisation, so that greedy tokens have clear margins and depend on the picture. Prompts go
through the model's own processor (as :mod:`nemo_rl.data.vlm` builds them for the policy): pictures of
different sizes (4, 8 and 16 image tokens), two different pictures of the same size (the same tokens), and a
text-only prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image

from nemo_rl.data.tiny_clevr import draw_scene, scene_shapes
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

QUESTION = "How many shapes are in the picture?"


def build_vlm(path: Path, seed: int = 0, scale: float = 0.2, family: str = "qwen2_5_vl") -> Any:
    """The tiny Qwen2.5-VL (or with ``family="qwen2_vl"`` the tiny Qwen2-VL) with weights drawn from
    N(0, scale) (norm weights kept at 1), saved with its processor under ``path``; returns the transformers
    model (fp32, eval)."""
    from transformers import AutoModelForImageTextToText

    from nemo_rl.data.tiny_vlm import build_tiny_qwen2_vl, build_tiny_vlm

    (build_tiny_vlm if family == "qwen2_5_vl" else build_tiny_qwen2_vl)(path, seed=seed)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and "ln_q" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(path)
    return model


def pictures() -> list[Image.Image | None]:
    """Three picture sizes, a second 56x56 picture, and no picture (a text prompt)."""
    import random

    def scene(seed: int, size: int) -> Image.Image:
        return draw_scene(scene_shapes(random.Random(seed), size, 3), size)

    wide = scene(3, 112).resize((112, 56))
    return [scene(1, 56), scene(2, 112), wide, scene(4, 56), None]


def image_prompts(
    processor: Any, images: list[Image.Image | list[Image.Image] | None]
) -> list[dict[str, Any]]:
    """Each picture (or list of pictures, or none) with the question, through the processor with the
    generation prompt: ``input_ids`` ``[T]``, ``pixel_values`` and ``image_grid_thw`` (``None`` for a text
    prompt)."""
    prompts = []
    for entry in images:
        pictures = [] if entry is None else entry if isinstance(entry, list) else [entry]
        content = [{"type": "image", "image": p} for p in pictures] + [{"type": "text", "text": QUESTION}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        inputs = processor(text=[text], images=pictures or None, return_tensors="pt")
        prompts.append(
            {
                "input_ids": inputs["input_ids"][0],
                "pixel_values": inputs.get("pixel_values"),
                "image_grid_thw": inputs.get("image_grid_thw"),
            }
        )
    return prompts


def generation_batch(prompts: list[dict[str, Any]], pad_token_id: int) -> BatchedDataDict[Any]:
    """The prompts as a generation batch (right-padded ``input_ids``, per-row images)."""
    width = max(int(p["input_ids"].shape[0]) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, : prompt["input_ids"].shape[0]] = prompt["input_ids"]
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=torch.tensor([int(p["input_ids"].shape[0]) for p in prompts]),
        pixel_values=[p["pixel_values"] for p in prompts],
        image_grid_thw=[p["image_grid_thw"] for p in prompts],
    )


def hf_inputs(model: Any, prompt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """transformers' keywords for one prompt (the placeholders' token types too: without them transformers
    gives the image tokens 1-D positions)."""
    ids = prompt["input_ids"][None]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prompt["pixel_values"] is not None:
        inputs["pixel_values"] = prompt["pixel_values"]
        inputs["image_grid_thw"] = prompt["image_grid_thw"]
        inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    return inputs


def hf_greedy(model: Any, prompt: dict[str, Any], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` for one prompt: the generated tokens (to EOS, included)."""
    with torch.no_grad():
        out = model.generate(**hf_inputs(model, prompt), max_new_tokens=max_new_tokens, do_sample=False)
    return [int(t) for t in out[0, prompt["input_ids"].shape[0] :]]


def generated(out: BatchedDataDict[Any], row: int) -> list[int]:
    """The tokens a generation backend generated for ``row``."""
    end = int(out["unpadded_sequence_lengths"][row])
    start = end - int(out["generation_lengths"][row])
    return [int(t) for t in out["output_ids"][row, start:end]]


def hf_token_logprobs(model: Any, prompt: dict[str, Any], tokens: list[int]) -> torch.Tensor:
    """``[len(tokens)]``: each generated token's log-prob under transformers' forward of prompt + tokens."""
    inputs = hf_inputs(model, prompt)
    ids = torch.cat((inputs["input_ids"], torch.tensor([tokens])), dim=1)
    inputs["input_ids"], inputs["attention_mask"] = ids, torch.ones_like(ids)
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    start = prompt["input_ids"].shape[0]
    logprobs = torch.log_softmax(logits[start - 1 : -1], dim=-1)
    return logprobs.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
