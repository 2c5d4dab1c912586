"""Held-out greedy accuracy of a tiny vision-language checkpoint on ``tiny_clevr``, with and without its images.

    uv run python tools/probes/tiny_clevr_accuracy.py MODEL_DIR [--num 256] [--seed 42] [--sampled]

``MODEL_DIR`` is a Hugging Face folder with its processor (an SFT run's ``hf_final`` export, or
``examples/assets/tiny_qwen25vl_init``). The pictures are the first ``--num`` validation scenes of
``data.seed`` ``--seed`` at the recipe's defaults (84 pixels, 1 to 5 shapes), never trained on. Each is
prompted as the recipe prompts it, answered greedily by ``transformers``' own ``generate`` (independent of the
project's workers) and scored by exact match with ``\\boxed{N}``. The same is done with every picture replaced
by the blank background, which shows how much of the accuracy comes from reading the picture. The standard
error is that of a proportion over the scenes. Runs in-process on CPU, no Ray.

``--sampled`` gives instead the exact expected accuracy of one sample at temperature 1 (pass@1 as GRPO samples
and ``run_eval.py`` estimates it): the probability of the answer ``\\boxed{N}`` and its end token, from one
teacher-forced forward per picture (other spellings of the right count, which the verifier also accepts, are
left out, so this is a slight lower bound). Its standard error is over the scenes.
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


def sampled_accuracy(model: Any, processor: Any, num: int, seed: int, blank: bool) -> tuple[float, float]:
    """Mean and standard error over the first ``num`` validation scenes of the probability that one sample at
    temperature 1 is exactly the right ``\\boxed{N}`` (see the module docstring)."""
    probabilities = []
    eos = int(processor.tokenizer.eos_token_id)
    for index in range(num):
        record = scene_record(seed, index, image_size=84, max_objects=5)
        image = record["messages"][0]["content"][0]["image"]
        if blank:
            image = Image.new("RGB", image.size, BACKGROUND)
        prompt = processor.apply_chat_template(
            record["messages"][:1], tokenize=False, add_generation_prompt=True
        )
        answer = f"\\boxed{{{record['expected_answer']}}}"
        inputs = processor(text=[prompt + answer], images=[image], return_tensors="pt")
        ids = torch.cat([inputs["input_ids"], torch.tensor([[eos]])], dim=1)
        inputs["input_ids"] = ids
        inputs["attention_mask"] = torch.ones_like(ids)
        inputs["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros(1, 1).long()], dim=1
        )
        num_answer = len(processor.tokenizer.encode(answer, add_special_tokens=False)) + 1
        with torch.no_grad():
            logits = model(**inputs).logits[0, -num_answer - 1 : -1].float()
        logprob = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, -num_answer:, None]).sum()
        probabilities.append(float(logprob.exp()))
    mean = sum(probabilities) / num
    variance = sum((p - mean) ** 2 for p in probabilities) / max(num - 1, 1)
    return mean, math.sqrt(variance / num)


def main() -> None:
    """Print the accuracy with and without the pictures."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--num", type=int, default=256)
    parser.add_argument("--seed", type=int, default=42, help="data.seed of the recipe")
    parser.add_argument("--sampled", action="store_true", help="expected sampled accuracy at temperature 1")
    args = parser.parse_args()
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model_dir).eval()
    processor = AutoProcessor.from_pretrained(args.model_dir)
    for blank in (False, True):
        what = "pictures blanked" if blank else "with the pictures"
        if args.sampled:
            mean, error = sampled_accuracy(model, processor, args.num, args.seed, blank)
            print(
                f"{args.model_dir} {what}: sampled accuracy {100 * mean:.1f}% ± {100 * error:.1f} (n={args.num})"
            )
            continue
        accuracy = greedy_accuracy(model, processor, args.num, args.seed, blank)
        error = math.sqrt(accuracy * (1 - accuracy) / args.num)
        print(
            f"{args.model_dir} {what}: greedy accuracy {100 * accuracy:.1f}% ± {100 * error:.1f} (n={args.num})"
        )


if __name__ == "__main__":
    main()
