"""Write the long-document SFT data of the context-parallel recipe (examples/configs/sft_tiny_long_cp.yaml):
conversations of one short user turn and one assistant turn of 7,000 to 8,100 characters, which the tiny
character-level tokenizer turns into rows of as many tokens, each trained whole (no packing).

    python examples/data/make_tiny_long_docs.py examples/data

writes ``tiny_long_docs_sft.jsonl`` (``openai_format``) with a fixed seed. Each assistant turn is a worksheet of
addition and subtraction lines (``12+7=19``) with operands from 0 to 50, the tiny arithmetic task's, so the loss
falls as the model learns the format and the sums at every position of the long row.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

NUM_DOCS = 40
MIN_CHARS, MAX_CHARS = 7000, 8100
"""The assistant turn's length; with the chat template's few tokens a row stays under 8,192 tokens."""
MAX_OPERAND = 50
SEED = 16


def worksheet(rng: random.Random, num_chars: int) -> str:
    """Lines ``a+b=c`` / ``a-b=c`` up to ``num_chars`` characters."""
    lines: list[str] = []
    length = 0
    while True:
        a, b, op = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND), rng.choice("+-")
        line = f"{a}{op}{b}={a + b if op == '+' else a - b}"
        if length + len(line) + 1 > num_chars:
            return "\n".join(lines)
        lines.append(line)
        length += len(line) + 1


def documents(num: int, seed: int) -> list[dict[str, Any]]:
    """``num`` conversations (``openai_format``), each one long worksheet."""
    rng = random.Random(seed)
    return [
        {
            "messages": [
                {"role": "user", "content": f"Worksheet {index}: solve every line."},
                {"role": "assistant", "content": worksheet(rng, rng.randint(MIN_CHARS, MAX_CHARS))},
            ]
        }
        for index in range(num)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    out_dir: Path = parser.parse_args().out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tiny_long_docs_sft.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for row in documents(NUM_DOCS, SEED):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {NUM_DOCS} documents to {path}")


if __name__ == "__main__":
    main()
