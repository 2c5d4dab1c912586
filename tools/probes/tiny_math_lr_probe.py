"""How far, and how fast, can a fresh optimizer move the tiny arithmetic checkpoint? An in-process probe.

    uv run python tools/probes/tiny_math_lr_probe.py --objective grpo --lr 1e-4 --steps 30
    uv run python tools/probes/tiny_math_lr_probe.py --objective sft --lr 3e-4 --steps 20 --prompts 64

Trains ``examples/assets/tiny_math_sft`` (or ``--model``) on the tiny_math training problems, in this process
with ``transformers`` and ``torch.optim`` (no Ray, none of the project's workers), with one of two objectives:

* ``grpo``: ``--prompts`` x ``--generations`` samples at temperature 1, a 0/1 reward for the reference
  answer in ``\\boxed{}``, group mean/std advantages (zero for groups that all agree), the token-level
  clipped policy-gradient loss of ``grpo_math_tiny.yaml``, ``--optimizer-steps-per-batch`` mini-batches;
* ``sft``: cross-entropy on the reference solutions of ``--prompts`` problems (the ground truth);
* ``distill``: on-policy distillation, one sample per problem, the per-token KL to ``--teacher``'s full
  next-token distribution (``--kl forward`` or ``reverse``) at every sampled response token.

Every ``--eval-every`` steps it prints the exact expected held-out sampled accuracy
(``tiny_math_accuracy.exact_accuracy_of``: the mean probability of the reference solution over the 256
held-out problems, no sampling noise), so an optimizer setting can be judged in a few minutes. The SFT
objective is the control: a learning rate at which even the ground truth lowers held-out accuracy is one no
RL reward can use either.
"""

from __future__ import annotations

import argparse
import random
import re
import time

import torch
from tiny_math_accuracy import exact_accuracy_of, heldout

from nemo_rl.data.tiny import tiny_math_splits

ANSWER = re.compile(r"\\boxed\{(-?\d+)\}")


def main() -> None:
    """Run the probe and print the training reward per step and the held-out accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="examples/assets/tiny_math_sft")
    parser.add_argument("--objective", choices=("grpo", "sft", "distill"), default="grpo")
    parser.add_argument("--teacher", default="examples/assets/tiny_math_teacher")
    parser.add_argument("--kl", choices=("forward", "reverse"), default="forward")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=16)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--warmup", type=int, default=5, help="linear warm-up from 0.1 x lr over this many steps"
    )
    parser.add_argument(
        "--decay-to", type=float, default=None, help="linear decay to this x lr by the last step"
    )
    parser.add_argument("--optimizer-steps-per-batch", type=int, default=1)
    parser.add_argument("--positive-only", action="store_true", help="GRPO with negative advantages set to 0")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    config, tokenizer, val, val_rows, model = heldout(args.model)
    assert config.data.seed is not None
    train_rows, _ = tiny_math_splits(
        config.data.num_train_samples,
        config.data.num_val_samples,
        seed=config.data.seed,
        max_operand=config.data.tiny_math_max_operand,
    )
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    teacher = heldout(args.teacher)[4] if args.objective == "distill" else None
    max_new_tokens = config.policy.generation.max_new_tokens

    def prompt_ids(problem: str) -> list[int]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def sample(prompts_N: list[list[int]]) -> list[list[int]]:
        width = max(map(len, prompts_N))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts_N])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_N])
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=attention,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        responses = []
        for row in out[:, width:].tolist():
            cut = row.index(eos) + 1 if eos in row else len(row)
            responses.append(row[:cut])
        return responses

    def logprobs(ids_NT: torch.Tensor) -> torch.Tensor:
        logits = model(ids_NT).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids_NT[:, 1:, None]).squeeze(-1)

    if args.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def lr_factor(step: int) -> float:
        if step < args.warmup:
            return 0.1 + 0.9 * step / args.warmup
        if args.decay_to is None:
            return 1.0
        return 1.0 + (args.decay_to - 1.0) * (step - args.warmup) / max(args.steps - args.warmup, 1)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    start_s = time.perf_counter()

    def report(step: int) -> None:
        model.eval()
        mean, se = exact_accuracy_of(model, tokenizer, val, val_rows, 1.0)
        model.train()
        print(f"step {step}: held-out exact expected sampled accuracy {100 * mean:.1f}% +- {100 * se:.1f}")

    report(0)
    order = list(range(len(train_rows)))
    rng.shuffle(order)
    rewards_per_step = []
    for step in range(1, args.steps + 1):
        rows = [train_rows[order[(step * args.prompts + i) % len(order)]] for i in range(args.prompts)]
        if args.objective == "distill":
            prompts_N = [prompt_ids(r["problem"]) for r in rows]
            model.eval()
            responses = sample(prompts_N)
            model.train()
            advantages_N = torch.zeros(len(rows))
            reward = sum(
                float(
                    (found := ANSWER.search(tokenizer.decode(resp, skip_special_tokens=True))) is not None
                    and found.group(1) == r["expected_answer"]
                )
                for resp, r in zip(responses, rows, strict=True)
            ) / len(rows)
        elif args.objective == "sft":
            prompts_N = [prompt_ids(r["problem"]) for r in rows]
            responses = [
                [*tokenizer(r["generated_solution"], add_special_tokens=False)["input_ids"], eos]
                for r in rows
            ]
            advantages_N = torch.ones(len(rows))
            reward = float("nan")
        else:
            g = args.generations
            prompts_N = [prompt_ids(r["problem"]) for r in rows for _ in range(g)]
            model.eval()
            responses = sample(prompts_N)
            model.train()
            rewards = []
            for i, response in enumerate(responses):
                found = ANSWER.search(tokenizer.decode(response, skip_special_tokens=True))
                rewards.append(float(found is not None and found.group(1) == rows[i // g]["expected_answer"]))
            rewards_GK = torch.tensor(rewards).view(-1, g)
            std_G1 = rewards_GK.std(1, keepdim=True)
            advantages_GK = (rewards_GK - rewards_GK.mean(1, keepdim=True)) / (std_G1 + 1e-6)
            advantages_N = torch.where(std_G1 > 0, advantages_GK, torch.zeros_like(advantages_GK)).view(-1)
            if args.positive_only:
                advantages_N = advantages_N.clamp(min=0)
            reward = float(rewards_GK.mean())
        sequences = [p + r for p, r in zip(prompts_N, responses, strict=True)]
        width = max(map(len, sequences))
        ids_NT = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
        mask_NT = torch.zeros(len(sequences), width - 1)
        for i, (p, r) in enumerate(zip(prompts_N, responses, strict=True)):
            mask_NT[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
        with torch.no_grad():
            old_NT = logprobs(ids_NT)
        per_step = len(sequences) // args.optimizer_steps_per_batch
        permutation = torch.randperm(len(sequences))
        for k in range(args.optimizer_steps_per_batch):
            rows_B = permutation[k * per_step : (k + 1) * per_step]
            if teacher is not None:
                student_BTV = torch.log_softmax(model(ids_NT[rows_B]).logits[:, :-1].float(), -1)
                with torch.no_grad():
                    teacher_BTV = torch.log_softmax(teacher(ids_NT[rows_B]).logits[:, :-1].float(), -1)
                if args.kl == "forward":
                    kl_BT = (teacher_BTV.exp() * (teacher_BTV - student_BTV)).sum(-1)
                else:
                    kl_BT = (student_BTV.exp() * (student_BTV - teacher_BTV)).sum(-1)
                loss = (kl_BT * mask_NT[rows_B]).sum() / mask_NT[rows_B].sum()
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                continue
            current_BT = logprobs(ids_NT[rows_B])
            ratio_BT = torch.exp(current_BT - old_NT[rows_B])
            adv_B1 = advantages_N[rows_B][:, None]
            loss_BT = torch.maximum(-adv_B1 * ratio_BT, -adv_B1 * ratio_BT.clamp(0.8, 1.2))
            loss = (loss_BT * mask_NT[rows_B]).sum() / mask_NT[rows_B].sum()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        scheduler.step()
        rewards_per_step.append(reward)
        print(
            f"step {step}: reward {reward:.3f} lr {scheduler.get_last_lr()[0]:.2e} [{time.perf_counter() - start_s:.0f} s]"
        )
        if step % args.eval_every == 0 or step == args.steps:
            report(step)
    if args.objective != "sft":
        tenth = max(len(rewards_per_step) // 10, 1)
        first, last = rewards_per_step[:tenth], rewards_per_step[-tenth:]
        print(
            f"training reward: first {tenth} steps {sum(first) / tenth:.3f}, last {tenth} {sum(last) / tenth:.3f}"
        )


if __name__ == "__main__":
    main()
