"""The tiny tokenizer, model and arithmetic generator that tests and CPU examples run on."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from nemo_rl.config.policy import TokenizerConfig
from nemo_rl.data.tiny import (
    CHARACTERS,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    generate_arithmetic_problems,
    main,
    num_arithmetic_problems,
    tiny_math_splits,
    write_tiny_math_jsonl,
)
from nemo_rl.models.tokenizer import get_tokenizer

ALL_CHARACTERS = "".join(CHARACTERS)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("tiny")
    build_tiny_tokenizer(root / "tokenizer")
    build_tiny_model(root / "model", root / "tokenizer", seed=0)
    return root


def _load(path: pathlib.Path) -> PreTrainedTokenizerBase:
    return get_tokenizer(TokenizerConfig(name=str(path)), model_name=None, trust_remote_code=False)


def test_vocabulary_is_about_a_hundred_symbols(tiny_dir: pathlib.Path) -> None:
    tokenizer = _load(tiny_dir / "tokenizer")
    assert len(tokenizer) == len(CHARACTERS) + len(SPECIAL_TOKENS) == 104
    for symbol in "0123456789+-=?.,:\\{} \n":
        assert symbol in CHARACTERS
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.bos_token == "<|bos|>"
    assert tokenizer.eos_token == "<|eos|>"
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3


@pytest.mark.parametrize("where", ["tokenizer", "model"])
def test_round_trip_is_lossless_after_loading(tiny_dir: pathlib.Path, where: str) -> None:
    # The model directory has a qwen2 config.json next to the tokenizer: the case AutoTokenizer mangles.
    tokenizer = _load(tiny_dir / where)
    text = ALL_CHARACTERS + "  What is 12+7?\n\n\\boxed{19}\t done. "
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(ids[:4]) == list(text[:4])


def test_special_tokens_are_single_tokens(tiny_dir: pathlib.Path) -> None:
    tokenizer = _load(tiny_dir / "model")
    for token in SPECIAL_TOKENS:
        ids = tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"]
        assert ids == [tokenizer.convert_tokens_to_ids(c) for c in ("a", token, "b")]


def test_unknown_characters_map_to_unk(tiny_dir: pathlib.Path) -> None:
    tokenizer = _load(tiny_dir / "tokenizer")
    ids = tokenizer("é", add_special_tokens=False)["input_ids"]
    assert ids == [tokenizer.convert_tokens_to_ids("<|unk|>")]


def test_chat_template(tiny_dir: pathlib.Path) -> None:
    tokenizer = _load(tiny_dir / "model")
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+2?"},
        {"role": "assistant", "content": "1+2=\\boxed{3}"},
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert text == "<|bos|><|system|>Be brief.<|user|>What is 1+2?<|assistant|>1+2=\\boxed{3}<|eos|>"
    prompt = tokenizer.apply_chat_template(conversation[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|system|>Be brief.<|user|>What is 1+2?<|assistant|>"
    with pytest.raises(Exception, match="no role wizard"):
        tokenizer.apply_chat_template([{"role": "wizard", "content": "x"}], tokenize=False)


def test_model_is_about_a_million_parameters_and_loads(tiny_dir: pathlib.Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model")
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers) == (128, 4)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.tie_word_embeddings and config.max_position_embeddings == 256
    assert config.vocab_size == 104
    num_params = sum(p.numel() for p in model.parameters())
    assert 500_000 <= num_params <= 1_200_000
    assert model.model.embed_tokens.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert (tiny_dir / "model" / "model.safetensors").is_file()
    tokenizer = _load(tiny_dir / "model")
    ids = torch.tensor([tokenizer("What is 1+2?", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 104)
    assert torch.isfinite(logits).all()


def test_model_weights_depend_only_on_seed(tmp_path: pathlib.Path, tiny_dir: pathlib.Path) -> None:
    rng_before = torch.random.get_rng_state()
    again = build_tiny_model(tmp_path / "again", tiny_dir / "tokenizer", seed=0)
    other = build_tiny_model(tmp_path / "other", tiny_dir / "tokenizer", seed=1)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    saved = AutoModelForCausalLM.from_pretrained(tiny_dir / "model").state_dict()
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    assert not torch.equal(other.model.layers[0].mlp.up_proj.weight, again.model.layers[0].mlp.up_proj.weight)


def test_arithmetic_problems_are_deterministic_and_correct() -> None:
    rows = generate_arithmetic_problems(200, seed=3)
    assert rows == generate_arithmetic_problems(200, seed=3)
    assert rows != generate_arithmetic_problems(200, seed=4)
    assert len({r["problem"] for r in rows}) == 200
    assert any("-" in r["problem"] for r in rows) and any("+" in r["problem"] for r in rows)
    for row in rows:
        match = re.fullmatch(r"What is (\d+)([+-])(\d+)\?", row["problem"])
        assert match, row
        a, op, b = int(match[1]), match[2], int(match[3])
        assert 0 <= a <= 50 and 0 <= b <= 50
        answer = a + b if op == "+" else a - b
        assert row["expected_answer"] == str(answer)
        assert row["generated_solution"].endswith(f"\\boxed{{{answer}}}")
        assert len(row["generated_solution"]) <= 20
        assert set(row["problem"] + row["generated_solution"]) <= set(CHARACTERS)


def test_arithmetic_problem_space_limits() -> None:
    assert num_arithmetic_problems(2) == 18
    assert len({r["problem"] for r in generate_arithmetic_problems(18, seed=0, max_operand=2)}) == 18
    with pytest.raises(ValueError, match="only 18 exist"):
        generate_arithmetic_problems(19, seed=0, max_operand=2)


def test_tiny_math_splits_are_disjoint() -> None:
    train, val = tiny_math_splits(100, 20, seed=0, max_operand=50)
    assert len(train) == 100 and len(val) == 20
    assert not {r["problem"] for r in train} & {r["problem"] for r in val}


def test_jsonl_writer(tmp_path: pathlib.Path) -> None:
    train_path, val_path = write_tiny_math_jsonl(
        tmp_path / "d", num_train=5, num_val=2, seed=7, max_operand=9
    )
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    val = [json.loads(line) for line in val_path.read_text().splitlines()]
    assert (train, val) == tuple(map(list, tiny_math_splits(5, 2, seed=7, max_operand=9)))


def test_command_line_builds_everything(tmp_path: pathlib.Path) -> None:
    main([str(tmp_path), "--num-train", "4", "--num-val", "2"])
    assert (tmp_path / "model" / "config.json").is_file()
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert len((tmp_path / "data" / "train.jsonl").read_text().splitlines()) == 4


CHECKED_IN = sorted(
    p.parent
    for p in (pathlib.Path(__file__).resolve().parents[2] / "examples" / "assets").glob("*/tokenizer.json")
)


@pytest.mark.parametrize("checkpoint", CHECKED_IN, ids=[p.name for p in CHECKED_IN])
def test_checked_in_tiny_checkpoints_load_losslessly(checkpoint: pathlib.Path) -> None:
    tokenizer = _load(checkpoint)
    text = ALL_CHARACTERS + " What is 12+7?\n"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|bos|><|user|>What is 1+2?<|assistant|>"
    config = json.loads((checkpoint / "config.json").read_text())
    # A vision-language model keeps its language model's settings under text_config.
    assert config.get("text_config", config)["vocab_size"] == len(tokenizer)


def test_validation_split_does_not_depend_on_training_size() -> None:
    # SFT and GRPO recipes train on different amounts of data but must share one held-out set.
    small_train, small_val = tiny_math_splits(100, 32, seed=42, max_operand=50)
    large_train, large_val = tiny_math_splits(4000, 32, seed=42, max_operand=50)
    assert small_val == large_val
    assert large_train[:100] == small_train
    assert not {r["problem"] for r in large_val} & {r["problem"] for r in large_train}
