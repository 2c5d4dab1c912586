"""Tiny, self-made assets so every test and CPU example runs without a hub: a character-level tokenizer,
a random ~1M-parameter Qwen2 model and a deterministic arithmetic dataset.

The tokenizer maps each printable ASCII character (plus tab and newline) to one token, so any text made of
those characters survives ``encode`` -> ``decode`` unchanged. Its chat template renders::

    <|bos|><|system|>...<|user|>What is 12+7?<|assistant|>12+7=\\boxed{19}<|eos|>

(``<|eos|>`` ends an assistant turn; the generation prompt is ``<|assistant|>``.) Arithmetic solutions are
~15 characters, short enough for the tiny model to generate on CPU.

Build everything at once with ``python -m nemo_rl.data.tiny OUT_DIR``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nemo_rl.config.data import DataConfig

if TYPE_CHECKING:
    from transformers import Qwen2ForCausalLM

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN, UNK_TOKEN)

# Printable ASCII (space to '~') plus tab and newline: 97 symbols, 104 tokens with the specials.
CHARACTERS = (*(chr(c) for c in range(32, 127)), "\t", "\n")

# Tool and environment turns are rendered as user turns: the tiny model knows only three roles. With
# `tools=`, a system turn lists them the Qwen way but short (`<tools>calculator(expression)</tools>`: names
# and argument names, since JSON schemas would not fit the tiny model's 256 positions), and each run of tool
# messages is one user turn of `<tool_response>...</tool_response>` blocks, as Qwen2.5 / Qwen3 render them.
_TINY_TOOLS = (
    "{% if tools %}" + SYSTEM_TOKEN + "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n"
    "{% endif %}<tools>{% for tool in tools %}"
    "{% set f = tool['function'] if tool['function'] is defined else tool %}"
    "{% set args = f['parameters']['properties'] if f['parameters'] is defined else {} %}"
    "{{ f['name'] }}({{ args | join(',') }}){% if not loop.last %} {% endif %}"
    "{% endfor %}</tools>{% endif %}"
)
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}" + _TINY_TOOLS + "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if not (tools and loop.first) %}" + SYSTEM_TOKEN + "{{ message['content'] }}{% endif %}"
    "{% elif message['role'] in ('user', 'environment') %}" + USER_TOKEN + "{{ message['content'] }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}" + USER_TOKEN + "{% endif %}"
    "<tool_response>{{ message['content'] }}</tool_response>"
    "{% elif message['role'] == 'assistant' %}"
    + ASSISTANT_TOKEN
    + "{{ message['content'] }}"
    + EOS_TOKEN
    + ""
    "{% else %}{{ raise_exception('the tiny chat template has no role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT_TOKEN + "{% endif %}"
)

TINY_HIDDEN_SIZE = 128
TINY_NUM_LAYERS = 4
TINY_NUM_HEADS = 4
TINY_NUM_KV_HEADS = 2
TINY_INTERMEDIATE_SIZE = 384
TINY_MAX_POSITION_EMBEDDINGS = 256


def build_tiny_tokenizer(path: str | pathlib.Path) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer, save it in Hugging Face format under ``path`` and return it.

    Load it back with :func:`nemo_rl.models.tokenizer.get_tokenizer` (``AutoTokenizer`` would rebuild it as a
    Qwen2 tokenizer once it sits next to a Qwen2 model and lose its whitespace handling).
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # Every character is its own word; `[\s\S]` (unlike `.`) also matches the newline.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates the pieces; the default decoder would join characters with spaces.
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN],
        model_max_length=TINY_MAX_POSITION_EMBEDDINGS,
        chat_template=TINY_CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(str(path))
    return tokenizer


def build_tiny_model(
    path: str | pathlib.Path, tokenizer_path: str | pathlib.Path, seed: int
) -> Qwen2ForCausalLM:
    """Build a randomly initialised ~0.8M-parameter ``Qwen2ForCausalLM`` for the tokenizer at
    ``tokenizer_path``, save it (safetensors) together with the tokenizer under ``path`` and return it.

    The same ``seed`` gives the same weights; the global torch RNG is left untouched.
    """
    # transformers' model code is imported here, not with the module: the data loaders import this module in
    # the driver, which never builds a model.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_path))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=TINY_HIDDEN_SIZE,
        num_hidden_layers=TINY_NUM_LAYERS,
        num_attention_heads=TINY_NUM_HEADS,
        num_key_value_heads=TINY_NUM_KV_HEADS,
        intermediate_size=TINY_INTERMEDIATE_SIZE,
        max_position_embeddings=TINY_MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=True,
        **tiny_token_ids(tokenizer),
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    save_tiny_model(model, tokenizer, path)
    return model


def tiny_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """The special-token ids a tiny model's config carries."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def save_tiny_model(model: Any, tokenizer: PreTrainedTokenizerFast, path: str | pathlib.Path) -> None:
    """Save a tiny model (safetensors, generation config with the tokenizer's ids) and its tokenizer."""
    for name, value in tiny_token_ids(tokenizer).items():
        setattr(model.generation_config, name, value)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def num_arithmetic_problems(max_operand: int) -> int:
    """How many distinct problems :func:`generate_arithmetic_problems` can draw from."""
    return 2 * (max_operand + 1) ** 2


def _problem_order(num: int, seed: int, max_operand: int) -> list[int]:
    """Codes of the first ``num`` problems in the seed's fixed order of all problems."""
    space = num_arithmetic_problems(max_operand)
    if not 0 <= num <= space:
        raise ValueError(
            f"cannot draw {num} distinct problems with max_operand={max_operand} (only {space} exist): "
            "ask for fewer or raise max_operand"
        )
    order = list(range(space))
    random.Random(seed).shuffle(order)
    return order[:num]


def generate_arithmetic_problems(num: int, seed: int, max_operand: int = 50) -> list[dict[str, str]]:
    """The first ``num`` problems of the seed's fixed order of all addition/subtraction problems.

    Each row has ``problem`` ("What is 12+7?"), ``generated_solution`` ("12+7=\\boxed{19}") and
    ``expected_answer`` ("19"); operands are drawn from 0 to ``max_operand`` and answers may be negative.
    The order does not depend on ``num``, so a larger ``num`` extends a smaller one.
    """
    return [_problem(code, max_operand) for code in _problem_order(num, seed, max_operand)]


def _operands(code: int, max_operand: int) -> tuple[int, str, int]:
    code, op_index = divmod(code, 2)
    b, a = divmod(code, max_operand + 1)
    return a, "+-"[op_index], b


def _solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def _solution(a: int, op: str, b: int, answer: int) -> str:
    return f"{a}{op}{b}=\\boxed{{{answer}}}"


def _problem(code: int, max_operand: int) -> dict[str, str]:
    a, op, b = _operands(code, max_operand)
    answer = _solve(a, op, b)
    return {
        "problem": f"What is {a}{op}{b}?",
        "generated_solution": _solution(a, op, b, answer),
        "expected_answer": str(answer),
    }


def plausible_wrong_answers(a: int, op: str, b: int, rng: random.Random, num: int = 1) -> list[int]:
    """Up to ``num`` distinct wrong answers to ``a op b`` of kinds people (and small models) make: off by one
    or by ten, the other operation, the operands swapped in a subtraction, or the last digit slipped. A
    problem has 5 to 7 of them; ``num`` beyond that gives them all. The first one does not depend on ``num``."""
    answer = _solve(a, op, b)
    candidates = {
        answer + 1,
        answer - 1,
        answer + 10,
        answer - 10,
        _solve(a, "-" if op == "+" else "+", b),
        b - a if op == "-" else answer + 2,
        answer - answer % 10 + (answer % 10 + rng.randint(2, 8)) % 10,
    }
    candidates.discard(answer)
    ordered = sorted(candidates)
    first = rng.choice(ordered)
    rest = [c for c in ordered if c != first]
    return [first, *rng.sample(rest, min(num - 1, len(rest)))]


def generate_arithmetic_preferences(
    num: int, seed: int, max_operand: int = 50, rejected_per_problem: int = 1
) -> list[dict[str, str]]:
    """Preference pairs over the same problems, in the same order, as :func:`generate_arithmetic_problems`.

    Each row has ``prompt`` ("What is 12+7?"), ``chosen`` ("12+7=\\boxed{19}", the correct solution) and
    ``rejected`` (the same solution with a :func:`plausible_wrong_answers` answer), the schema of
    ``dataset_name: binary_preference``. Each problem gives ``rejected_per_problem`` consecutive rows with
    different wrong answers (fewer when it has fewer); its first row depends only on ``seed`` and the problem.
    """
    rows = []
    for code in _problem_order(num, seed, max_operand):
        a, op, b = _operands(code, max_operand)
        rng = random.Random(f"{seed}:{a}{op}{b}")
        chosen = _solution(a, op, b, _solve(a, op, b))
        for wrong in plausible_wrong_answers(a, op, b, rng, rejected_per_problem):
            rows.append(
                {"prompt": f"What is {a}{op}{b}?", "chosen": chosen, "rejected": _solution(a, op, b, wrong)}
            )
    return rows


def tiny_math_splits(
    num_train: int,
    num_val: int,
    seed: int,
    max_operand: int,
    *,
    preferences: bool = False,
    rejected_per_problem: int = 1,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Disjoint training and validation rows: validation is the first ``num_val`` problems of the seed's
    order, training the next ``num_train``; ``preferences`` gives preference pairs instead of problems, with
    ``rejected_per_problem`` pairs for each training problem and one for each validation problem.

    Validation first keeps it the same whatever ``num_train`` is, so recipes that train on different
    amounts of data (SFT, then GRPO, DPO or a reward model) are scored on the same held-out problems, never
    trained on by any of them.
    """
    if not preferences:
        rows = generate_arithmetic_problems(num_val + num_train, seed=seed, max_operand=max_operand)
        return rows[num_val:], rows[:num_val]
    val = generate_arithmetic_preferences(num_val, seed=seed, max_operand=max_operand)
    both = generate_arithmetic_preferences(
        num_val + num_train, seed=seed, max_operand=max_operand, rejected_per_problem=rejected_per_problem
    )
    held_out = {row["prompt"] for row in val}
    return [row for row in both if row["prompt"] not in held_out], val


def write_jsonl(rows: Sequence[dict[str, Any]], path: str | pathlib.Path) -> pathlib.Path:
    """Write ``rows`` as JSON Lines to ``path`` (parent directories are created)."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return out


def write_tiny_math_jsonl(
    directory: str | pathlib.Path, *, num_train: int, num_val: int, seed: int, max_operand: int
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``train.jsonl`` and ``validation.jsonl`` of :func:`tiny_math_splits` under ``directory``."""
    train, val = tiny_math_splits(num_train, num_val, seed=seed, max_operand=max_operand)
    directory = pathlib.Path(directory)
    return write_jsonl(train, directory / "train.jsonl"), write_jsonl(val, directory / "validation.jsonl")


def main(argv: Sequence[str] | None = None) -> None:
    """Build ``OUT/tokenizer``, ``OUT/model`` and ``OUT/data/{train,validation}.jsonl``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    # The data schema owns the defaults; the command line mirrors them.
    defaults = DataConfig()
    parser.add_argument("--seed", type=int, default=0, help="seed of the model weights and the problems")
    parser.add_argument("--num-train", type=int, default=defaults.num_train_samples)
    parser.add_argument("--num-val", type=int, default=defaults.num_val_samples)
    parser.add_argument("--max-operand", type=int, default=defaults.tiny_math_max_operand)
    args = parser.parse_args(argv)
    build_tiny_tokenizer(args.out_dir / "tokenizer")
    model = build_tiny_model(args.out_dir / "model", args.out_dir / "tokenizer", seed=args.seed)
    train, val = write_tiny_math_jsonl(
        args.out_dir / "data",
        num_train=args.num_train,
        num_val=args.num_val,
        seed=args.seed,
        max_operand=args.max_operand,
    )
    print(f"model ({model.num_parameters()} parameters): {args.out_dir / 'model'}; data: {train}, {val}")


if __name__ == "__main__":
    main()
