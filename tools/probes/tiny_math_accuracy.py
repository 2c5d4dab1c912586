"""Held-out sampled accuracy of tiny checkpoints, with many samples per problem and standard errors.

    uv run python tools/probes/tiny_math_accuracy.py MODEL_DIR [MODEL_DIR ...] [--samples 16] [--temperature 1]

Each ``MODEL_DIR`` is a Hugging Face folder (``examples/assets/tiny_math_sft``, or a training checkpoint's
``step_<N>/consolidated`` export). The problems are the 256 held-out ``tiny_math`` validation problems
(operands 0 to 50, never trained on by the tiny SFT, GRPO or distillation recipes), prompted exactly as the
recipes prompt them. Every problem is sampled ``--samples`` times with ``transformers``' own ``generate``
(independent of the project's engines) at ``--temperature`` and scored by the math verifier; a greedy
answer is scored too. Accuracy is the mean over problems of each problem's fraction of correct samples; its
standard error is the standard deviation of those per-problem fractions over sqrt(problems), which counts
the problems, not the samples, as the independent draws. Runs in-process on CPU, no Ray.

It also prints the *exact* expected sampled accuracy, with no sampling noise: the mean over problems of the
probability, at ``--temperature``, of the reference solution followed by end-of-sequence (``48+8=\\boxed{56}``
then ``<|eos|>``), from one teacher-forced forward pass. A correct answer written differently is not
counted, so it is a lower bound; on the tiny checkpoints (whose answers all take the reference form) it
agrees with the sampled accuracy within its standard error. ``--exact-only`` prints only it (seconds per
checkpoint), which resolves changes of a point or less where sampling 256 x 8 cannot.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from nemo_rl.config.loader import load_and_validate
from nemo_rl.config.master import DistillationMasterConfig
from nemo_rl.data.datasets import setup_rl_data
from nemo_rl.data.tiny import tiny_math_splits
from nemo_rl.environments.math_verifier import verify_math_answer
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "configs" / "distillation_tiny_math.yaml"


def _mean_and_se(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    return mean, math.sqrt(variance / len(values))


def heldout(model_dir: str) -> tuple[Any, Any, Any, list[dict[str, str]], Any]:
    """The recipe's config, tokenizer, the held-out prompts as the recipes build them, their reference rows, and the model."""
    config = load_and_validate(RECIPE, DistillationMasterConfig, [f"policy.model_name={model_dir}"])
    tokenizer = get_policy_tokenizer(config.policy)
    _, val = setup_rl_data(
        config.data, tokenizer, max_total_sequence_length=config.policy.max_total_sequence_length
    )
    assert val is not None and config.data.seed is not None
    _, rows = tiny_math_splits(
        config.data.num_train_samples,
        config.data.num_val_samples,
        seed=config.data.seed,
        max_operand=config.data.tiny_math_max_operand,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return config, tokenizer, val, rows, model


def exact_accuracy_of(
    model: Any, tokenizer: Any, val: Any, rows: list[dict[str, str]], temperature: float
) -> tuple[float, float]:
    """Mean over the held-out problems of P(reference solution + EOS | prompt) at ``temperature``, and its
    standard error over problems, for a model already in memory."""
    probabilities: list[float] = []
    for i in range(len(val)):
        item = val[i]
        if item["extra_env_info"]["ground_truth"] != rows[i]["expected_answer"]:
            raise RuntimeError(f"held-out problem {i} does not match its reference row {rows[i]}")
        prompt_ids = torch.cat([m["token_ids"] for m in item["message_log"]])
        solution_ids = torch.tensor(
            [
                *tokenizer(rows[i]["generated_solution"], add_special_tokens=False)["input_ids"],
                tokenizer.eos_token_id,
            ]
        )
        ids = torch.cat([prompt_ids, solution_ids])[None]
        with torch.no_grad():
            logits = model(ids).logits[0, prompt_ids.shape[0] - 1 : -1].float() / temperature
        logprob = torch.log_softmax(logits, dim=-1).gather(-1, solution_ids[:, None]).sum()
        probabilities.append(math.exp(logprob.item()))
    return _mean_and_se(probabilities)


def exact_accuracy(model_dir: str, temperature: float) -> dict[str, float]:
    """:func:`exact_accuracy_of` the checkpoint in ``model_dir``."""
    _, tokenizer, val, rows, model = heldout(model_dir)
    mean, se = exact_accuracy_of(model, tokenizer, val, rows, temperature)
    return {"problems": float(len(val)), "exact_accuracy": mean, "exact_accuracy_se": se}


def evaluate(model_dir: str, samples: int, temperature: float, seed: int) -> dict[str, float]:
    """Sampled accuracy (mean, standard error), pass@samples and greedy accuracy of one checkpoint."""
    config, tokenizer, val, _, model = heldout(model_dir)
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
    parser.add_argument("--exact-only", action="store_true", help="print only the exact expected accuracy")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for model_dir in args.model_dirs:
        start_s = time.perf_counter()
        e = exact_accuracy(model_dir, args.temperature)
        print(
            f"{model_dir}: exact expected sampled accuracy {100 * e['exact_accuracy']:.1f}% "
            f"+- {100 * e['exact_accuracy_se']:.1f} (reference answers, T={args.temperature})",
            flush=True,
        )
        if args.exact_only:
            continue
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
