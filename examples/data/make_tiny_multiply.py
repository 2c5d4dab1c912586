"""Write the tiny tool-use task's data: multiplying two 4-digit numbers, which the tiny model cannot do alone
and can do with the calculator (docs/algorithms/agents.md).

    python examples/data/make_tiny_multiply.py examples/data

writes, with a fixed seed, three files of distinct problems:

- ``tiny_multiply_sft.jsonl``: SFT warm-up transcripts that call the calculator and answer with its result
  (``openai_format``; each row declares the calculator in ``tools``);
- ``tiny_multiply_train.jsonl``: RL problems (``problem`` and ``expected_answer``, OpenMathInstruct-2's
  schema);
- ``tiny_multiply_val.jsonl``: held-out problems in the same schema, never trained on by either.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from nemo_rl.environments.tools.calculator import calculator_tool

NUM_SFT = 1024
NUM_TRAIN = 2048
NUM_VAL = 256
SEED = 28


def problems(num: int, seed: int) -> list[tuple[int, int]]:
    """``num`` distinct pairs of 4-digit factors."""
    rng = random.Random(seed)
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < num:
        pairs[(rng.randint(1000, 9999), rng.randint(1000, 9999))] = None
    return list(pairs)


def question(a: int, b: int) -> str:
    """The user turn of a problem."""
    return f"What is {a}*{b}?"


def transcript(a: int, b: int) -> list[dict[str, str]]:
    """A conversation that calls the calculator on ``a*b`` and answers with the result, boxed."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
    return [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"\\boxed{{{a * b}}}"},
    ]


def rows() -> dict[str, list[dict[str, Any]]]:
    """The three files' rows, by file name."""
    pairs = problems(NUM_SFT + NUM_TRAIN + NUM_VAL, SEED)
    val, train, sft = pairs[:NUM_VAL], pairs[NUM_VAL : NUM_VAL + NUM_TRAIN], pairs[NUM_VAL + NUM_TRAIN :]
    tools = [calculator_tool().schema()]

    def prompt(a: int, b: int) -> dict[str, Any]:
        return {"problem": question(a, b), "expected_answer": str(a * b)}

    return {
        "tiny_multiply_sft.jsonl": [{"messages": transcript(a, b), "tools": tools} for a, b in sft],
        "tiny_multiply_train.jsonl": [prompt(a, b) for a, b in train],
        "tiny_multiply_val.jsonl": [prompt(a, b) for a, b in val],
    }


def main() -> None:
    """Write the files into the folder named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    out_dir = parser.parse_args().out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, file_rows in rows().items():
        with open(out_dir / name, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in file_rows)


if __name__ == "__main__":
    main()
