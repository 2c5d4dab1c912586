"""Held-out greedy accuracy of a tiny vision-language checkpoint on ``tiny_clevr``, with and without its images.

    uv run python tools/probes/tiny_clevr_accuracy.py MODEL_DIR [--num 256] [--seed 42]

``MODEL_DIR`` is a Hugging Face folder with its processor (an SFT run's ``hf_final`` export, or
``examples/assets/tiny_qwen25vl_init``). The pictures are the first ``--num`` validation scenes of
``data.seed`` ``--seed`` at the recipe's defaults (84 pixels, 1 to 5 shapes), never trained on. Each is
prompted as the recipe prompts it, answered greedily by ``transformers``' own ``generate`` (independent of the
project's workers) and scored by exact match with ``\\boxed{N}``. The same is done with every picture replaced
by the blank background, which shows how much of the accuracy comes from reading the picture. The standard
error is that of a proportion over the scenes. Runs in-process on CPU, no Ray.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from nemo_rl.data.tiny_clevr import BACKGROUND, scene_record


def greedy_accuracy(model: Any, processor: Any, num: int, seed: int, blank: bool) -> float:
    """Share of the first ``num`` validation scenes answered exactly (see the module docstring)."""
    correct = 0
    for index in range(num):
        record = scene_record(seed, index, image_size=84, max_objects=5)
        image = record["messages"][0]["content"][0]["image"]
        if blank:
            image = Image.new("RGB", image.size, BACKGROUND)
        prompt = processor.apply_chat_template(
            record["messages"][:1], tokenize=False, add_generation_prompt=True
        )
        inputs = processor(text=[prompt], images=[image], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
        answer = processor.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += answer.strip() == f"\\boxed{{{record['expected_answer']}}}"
    return correct / num


def main() -> None:
    """Print the accuracy with and without the pictures."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--num", type=int, default=256)
    parser.add_argument("--seed", type=int, default=42, help="data.seed of the recipe")
    args = parser.parse_args()
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model_dir).eval()
    processor = AutoProcessor.from_pretrained(args.model_dir)
    for blank in (False, True):
        accuracy = greedy_accuracy(model, processor, args.num, args.seed, blank)
        error = math.sqrt(accuracy * (1 - accuracy) / args.num)
        what = "pictures blanked" if blank else "with the pictures"
        print(
            f"{args.model_dir} {what}: greedy accuracy {100 * accuracy:.1f}% ± {100 * error:.1f} (n={args.num})"
        )


if __name__ == "__main__":
    main()
