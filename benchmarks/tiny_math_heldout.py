"""Held-out quality of tiny-math checkpoints, side by side: arithmetic accuracy, DPO preference accuracy and
reward-model pairwise accuracy, each with its standard error.

Everything is measured on the ``tiny_math`` validation problems (operands 0 to 50, seed 42: the first
``--num-problems`` of the seed's order), which no recipe trains on (SFT, GRPO, DPO and the reward model all
train on later problems of that order), and on their ``tiny_math_preference`` pairs (the correct boxed answer
against a plausible wrong one).

- Arithmetic accuracy: ``--samples`` responses per problem sampled at temperature 1 by the embedded engine,
  plus one greedy response; a response is correct when its last ``\\boxed{}`` holds the answer. The sampled
  accuracy is the mean over problems of each problem's success rate; its standard error is the standard
  deviation of those rates over sqrt(problems). Against the first checkpoint the paired difference is
  reported with its own standard error (per-problem differences).
- ``--dpo-reference REF``: for every causal-LM checkpoint, the fraction of held-out pairs whose chosen
  response has the larger DPO implicit reward ``log pi - log pi_ref`` (summed over the response tokens).
- ``--reward-model RM`` (repeatable): the fraction of held-out pairs the reward model scores chosen above
  rejected.
- ``--score-with RM``: for every causal-LM checkpoint, the reward model's mean score of its sampled responses
  (the held-out reward of GRPO scored by that reward model), per problem; against the first checkpoint the
  paired difference with its own standard error.

    uv run python benchmarks/tiny_math_heldout.py examples/assets/tiny_math_sft results/dpo_tiny_math/hf_final \\
        --dpo-reference examples/assets/tiny_math_sft --reward-model results/rm_tiny_math/hf_final
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from nemo_rl.config.data import DataConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.collate_fn import make_preference_collate_fn
from nemo_rl.data.datasets import setup_preference_data, setup_rl_data
from nemo_rl.data.llm_message_utils import message_logs_to_batch
from nemo_rl.environments.math_verifier import extract_last_boxed
from nemo_rl.models.generation.embedded.engine import EmbeddedEngine, SamplingParams
from nemo_rl.models.generation.embedded.model import DecoderLM
from nemo_rl.models.tokenizer import get_policy_tokenizer

MAX_SEQUENCE_LENGTH = 64
MAX_NEW_TOKENS = 24


@dataclass(frozen=True)
class Rate:
    """A mean over problems and its standard error."""

    mean: float
    stderr: float

    def __str__(self) -> str:
        return f"{100 * self.mean:5.1f}% ± {100 * self.stderr:.1f}"


def rate(values: torch.Tensor) -> Rate:
    """Mean of per-problem values and the standard error of that mean."""
    n = values.numel()
    return Rate(float(values.mean()), float(values.std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0)


def data_config(num_problems: int, dataset_name: str) -> DataConfig:
    # The recipes' data settings: seed 42, operands 0..50; the validation split is the held-out problems.
    return DataConfig.model_validate(
        {"dataset_name": dataset_name, "num_train_samples": 1, "num_val_samples": num_problems, "seed": 42}
    )


def arithmetic_success(
    path: str, num_problems: int, samples: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-problem success rate over ``samples`` sampled responses, greedy success (0/1), and the sampled
    conversations (``[samples * problems, T]`` prompt + response, right-padded; sample-major) of ``path``."""
    tokenizer = get_policy_tokenizer(PolicyConfig(model_name=path))
    _, val = setup_rl_data(
        data_config(num_problems, "tiny_math"), tokenizer, max_total_sequence_length=MAX_SEQUENCE_LENGTH
    )
    assert val is not None
    prompts = message_logs_to_batch(
        [val[i]["message_log"] for i in range(len(val))], pad_token_id=tokenizer.pad_token_id, train_roles=()
    )
    answers = [str(val[i]["extra_env_info"]["ground_truth"]) for i in range(len(val))]  # type: ignore[index]
    engine = EmbeddedEngine(
        DecoderLM.from_pretrained(path, dtype=torch.float32),
        pad_token_id=tokenizer.pad_token_id,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        decode_fn=None,
    )
    params = SamplingParams(
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        max_new_tokens=MAX_NEW_TOKENS,
        stop_token_ids=frozenset([tokenizer.eos_token_id]),
        stop_strings=(),
    )

    def correct(output_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        texts = [
            tokenizer.decode(ids[int(n) : int(m)].tolist())
            for ids, n, m in zip(
                output_ids, lengths, output_ids.ne(tokenizer.pad_token_id).sum(1), strict=True
            )
        ]
        return torch.tensor(
            [
                extract_last_boxed(t) == a
                for t, a in zip(texts, answers * (len(texts) // len(answers)), strict=True)
            ],
            dtype=torch.float32,
        )

    ids, lengths = prompts["input_ids"], prompts["input_lengths"]
    greedy = engine.generate(ids, lengths, params, greedy=True, seed=seed)
    greedy_ok = correct(greedy.output_ids, lengths)
    repeated_ids, repeated_lengths = ids.repeat(samples, 1), lengths.repeat(samples)
    sampled = engine.generate(repeated_ids, repeated_lengths, params, greedy=False, seed=seed)
    sampled_ok = correct(sampled.output_ids, repeated_lengths).reshape(samples, len(answers))
    return sampled_ok.mean(0), greedy_ok, sampled.output_ids


def heldout_pairs(tokenizer_path: str, num_problems: int) -> dict[str, torch.Tensor]:
    """The held-out preference pairs as one interleaved batch (row 2i chosen, 2i + 1 rejected)."""
    tokenizer = get_policy_tokenizer(PolicyConfig(model_name=tokenizer_path))
    cfg = data_config(num_problems, "tiny_math_preference").model_copy(update={"add_generation_prompt": True})
    _, val = setup_preference_data(cfg, tokenizer, max_total_sequence_length=MAX_SEQUENCE_LENGTH)
    assert val is not None
    return dict(make_preference_collate_fn(tokenizer, MAX_SEQUENCE_LENGTH)([val[i] for i in range(len(val))]))


@torch.no_grad()
def sequence_logprobs(path: str, pairs: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] summed log-probability of each row's response tokens under the causal LM at ``path``."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    logits = model(input_ids=pairs["input_ids"]).logits[:, :-1].float()
    token_lp = torch.log_softmax(logits, -1).gather(-1, pairs["input_ids"][:, 1:, None]).squeeze(-1)
    return (token_lp * pairs["token_mask"][:, 1:]).sum(-1)


@torch.no_grad()
def reward_scores(path: str, pairs: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] reward of each row under the sequence-classification model at ``path``."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    valid = torch.arange(pairs["input_ids"].shape[1])[None, :] < pairs["input_lengths"][:, None]
    ids = torch.where(valid, pairs["input_ids"], model.config.pad_token_id)
    return model(input_ids=ids).logits.float().reshape(-1)


@torch.no_grad()
def mean_scores(path: str, conversations: torch.Tensor, num_problems: int) -> torch.Tensor:
    """[problems] mean reward of each problem's sampled conversations (right-padded with the pad id, which
    the reward model's config shares) under the sequence-classification model at ``path``."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    scores = torch.cat(
        [model(input_ids=chunk).logits.float().reshape(-1) for chunk in conversations.split(512)]
    )
    return scores.reshape(-1, num_problems).mean(0)


def pair_accuracy(scores: torch.Tensor) -> Rate:
    """Fraction (and standard error) of pairs whose chosen row (even rows) scores above its rejected row."""
    return rate((scores[0::2] > scores[1::2]).float())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="causal-LM checkpoints (the first is the baseline)")
    parser.add_argument("--num-problems", type=int, default=256)
    parser.add_argument("--samples", type=int, default=32, help="sampled responses per problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dpo-reference", help="reference model of the DPO implicit reward")
    parser.add_argument("--reward-model", action="append", default=[], help="reward model to score the pairs")
    parser.add_argument("--score-with", help="reward model to score every checkpoint's sampled responses")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    pairs = heldout_pairs(args.checkpoints[0], args.num_problems)
    reference_lp = sequence_logprobs(args.dpo_reference, pairs) if args.dpo_reference else None
    baseline: torch.Tensor | None = None
    baseline_score: torch.Tensor | None = None
    print(f"{args.num_problems} held-out problems, {args.samples} samples each at temperature 1")
    for path in args.checkpoints:
        sampled, greedy, conversations = arithmetic_success(path, args.num_problems, args.samples, args.seed)
        line = f"{path}: sampled {rate(sampled)}, greedy {rate(greedy)}"
        if baseline is None:
            baseline = sampled
        else:
            line += f", sampled vs first {100 * rate(sampled - baseline).mean:+.1f} ± {100 * rate(sampled - baseline).stderr:.1f} points"
        if reference_lp is not None:
            line += (
                f", DPO preference accuracy {pair_accuracy(sequence_logprobs(path, pairs) - reference_lp)}"
            )
        if args.score_with:
            score = mean_scores(args.score_with, conversations, args.num_problems)
            line += f", reward-model score {float(score.mean()):.3f} ± {rate(score).stderr:.3f}"
            if baseline_score is None:
                baseline_score = score
            else:
                diff = rate(score - baseline_score)
                line += f" (vs first {diff.mean:+.3f} ± {diff.stderr:.3f})"
        print(line, flush=True)
    for path in args.reward_model:
        print(
            f"{path}: reward-model pairwise accuracy {pair_accuracy(reward_scores(path, pairs))}", flush=True
        )


if __name__ == "__main__":
    main()
