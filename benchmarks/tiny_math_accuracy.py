"""Held-out sampled accuracy of tiny checkpoints, with many samples per problem and standard errors.

    uv run python benchmarks/tiny_math_accuracy.py MODEL_DIR [MODEL_DIR ...] [--samples 16] [--temperature 1]

Each ``MODEL_DIR`` is a Hugging Face folder (``examples/assets/tiny_math_sft``, or a training checkpoint's
``step_<N>/consolidated`` export). The problems are the 256 held-out ``tiny_math`` validation problems
(operands 0 to 50, never trained on by the tiny SFT, GRPO or distillation recipes), prompted exactly as the
recipes prompt them. Every problem is sampled ``--samples`` times with ``transformers``' own ``generate``
(independent of the project's engines) at ``--temperature`` and scored by the math verifier; a greedy
answer is scored too. Accuracy is the mean over problems of each problem's fraction of correct samples; its
standard error is the standard deviation of those per-problem fractions over sqrt(problems), which counts
the problems, not the samples, as the independent draws. Runs in-process on CPU, no Ray.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from nemo_rl.config.loader import load_and_validate
from nemo_rl.config.master import DistillationMasterConfig
from nemo_rl.data.datasets import setup_rl_data
from nemo_rl.environments.math_verifier import verify_math_answer
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "configs" / "distillation_tiny_math.yaml"


def _mean_and_se(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    return mean, math.sqrt(variance / len(values))


def evaluate(model_dir: str, samples: int, temperature: float, seed: int) -> dict[str, float]:
    """Sampled accuracy (mean, standard error), pass@samples and greedy accuracy of one checkpoint."""
    config = load_and_validate(RECIPE, DistillationMasterConfig, [f"policy.model_name={model_dir}"])
    tokenizer = get_policy_tokenizer(config.policy)
    _, val = setup_rl_data(
        config.data, tokenizer, max_total_sequence_length=config.policy.max_total_sequence_length
    )
    assert val is not None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    per_problem: list[float] = []
    greedy: list[float] = []
    for i in range(len(val)):
        item = val[i]
        prompt_ids = torch.cat([m["token_ids"] for m in item["message_log"]])[None]
        truth = item["extra_env_info"]["ground_truth"]
        with torch.no_grad():
            outputs = {
                name: model.generate(
                    prompt_ids,
                    attention_mask=torch.ones_like(prompt_ids),
                    max_new_tokens=config.policy.generation.max_new_tokens,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    **kwargs,
                )
                for name, kwargs in (
                    (
                        "sampled",
                        {
                            "do_sample": True,
                            "temperature": temperature,
                            "top_k": 0,
                            "top_p": 1.0,
                            "num_return_sequences": samples,
                        },
                    ),
                    ("greedy", {"do_sample": False}),
                )
            }
        scores = [
            verify_math_answer(tokenizer.decode(row[prompt_ids.shape[1] :], skip_special_tokens=True), truth)
            for row in outputs["sampled"]
        ]
        per_problem.append(sum(scores) / len(scores))
        answer = tokenizer.decode(outputs["greedy"][0, prompt_ids.shape[1] :], skip_special_tokens=True)
        greedy.append(verify_math_answer(answer, truth))
    accuracy, se = _mean_and_se(per_problem)
    greedy_accuracy, greedy_se = _mean_and_se(greedy)
    return {
        "problems": float(len(per_problem)),
        "accuracy": accuracy,
        "accuracy_se": se,
        "pass_at_samples": sum(p > 0 for p in per_problem) / len(per_problem),
        "greedy_accuracy": greedy_accuracy,
        "greedy_se": greedy_se,
    }


def main() -> None:
    """Print one line per checkpoint: sampled accuracy +- standard error, pass@n, greedy accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model_dirs", nargs="+")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for model_dir in args.model_dirs:
        start_s = time.perf_counter()
        r = evaluate(model_dir, args.samples, args.temperature, args.seed)
        print(
            f"{model_dir}: sampled accuracy {100 * r['accuracy']:.1f}% +- {100 * r['accuracy_se']:.1f} "
            f"({args.samples} samples x {int(r['problems'])} problems, T={args.temperature}), "
            f"pass@{args.samples} {100 * r['pass_at_samples']:.1f}%, greedy {100 * r['greedy_accuracy']:.1f}% "
            f"+- {100 * r['greedy_se']:.1f}  [{time.perf_counter() - start_s:.0f} s]",
            flush=True,
        )


if __name__ == "__main__":
    main()
