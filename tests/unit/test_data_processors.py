"""Message logs and processors: turn-by-turn token ids, masks, prompts, ground truth and truncation."""

from __future__ import annotations

import pathlib

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from nemo_rl.config.data import DataConfig
from nemo_rl.config.policy import TokenizerConfig
from nemo_rl.data.interfaces import ChatMessage, Record, TaskDataSpec
from nemo_rl.data.llm_message_utils import (
    append_message,
    format_message_log,
    message_log_length,
    message_log_token_ids,
    message_logs_to_batch,
    truncate_message_log,
)
from nemo_rl.data.processors import math_processor, sft_processor
from nemo_rl.data.tiny import build_tiny_tokenizer
from nemo_rl.models.tokenizer import get_tokenizer, resolve_chat_template

CONVERSATION = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="What is 1+2?"),
    ChatMessage(role="assistant", content="1+2=\\boxed{3}"),
    ChatMessage(role="user", content="And 2+2?"),
    ChatMessage(role="assistant", content="4"),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(path)
    return get_tokenizer(TokenizerConfig(name=str(path)), model_name=None, trust_remote_code=False)


def _spec(**overrides: object) -> TaskDataSpec:
    fields: dict[str, object] = {
        "task_name": "math",
        "prompt": None,
        "system_prompt": None,
        "add_bos": True,
        "add_eos": True,
        "add_generation_prompt": True,
    }
    fields.update(overrides)
    return TaskDataSpec(**fields)  # type: ignore[arg-type]


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_message_log_concatenates_to_the_rendered_conversation(
    tokenizer: PreTrainedTokenizerBase, add_generation_prompt: bool
) -> None:
    log = format_message_log(
        CONVERSATION, tokenizer, add_bos=True, add_eos=True, add_generation_prompt=add_generation_prompt
    )
    full_text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in CONVERSATION], tokenize=False
    )
    assert isinstance(full_text, str)
    assert message_log_token_ids(log).tolist() == _ids(tokenizer, full_text)
    assert [m["role"] for m in log] == [m["role"] for m in CONVERSATION]
    for message in log:
        assert message["token_ids"].dtype == torch.long and message["token_ids"].ndim == 1
        assert tokenizer.decode(message["token_ids"].tolist()) == message["content"]
    # The assistant header belongs to the user turn only when add_generation_prompt asks for it.
    header = "<|assistant|>"
    assert log[1]["content"].endswith(header) == add_generation_prompt
    assert log[2]["content"].startswith(header) != add_generation_prompt
    assert log[0]["content"] == "<|bos|><|system|>Be brief."
    assert log[4]["content"].endswith("4<|eos|>")


def test_bos_and_eos_added_when_template_lacks_them(tokenizer: PreTrainedTokenizerBase) -> None:
    original = tokenizer.chat_template
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    try:
        log = format_message_log(
            CONVERSATION[1:3], tokenizer, add_bos=True, add_eos=True, add_generation_prompt=False
        )
        plain = format_message_log(
            CONVERSATION[1:3], tokenizer, add_bos=False, add_eos=False, add_generation_prompt=False
        )
    finally:
        tokenizer.chat_template = original
    ids = message_log_token_ids(log).tolist()
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert ids[1:-1] == message_log_token_ids(plain).tolist()
    assert tokenizer.decode(plain[0]["token_ids"].tolist()) == "user: What is 1+2?\n"


def test_format_errors(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="empty conversation"):
        format_message_log([], tokenizer, add_bos=True, add_eos=True, add_generation_prompt=True)
    with pytest.raises(ValueError, match=r"message 1 .* needs 'role' and 'content'"):
        bad = [CONVERSATION[0], {"role": "user"}]
        format_message_log(bad, tokenizer, add_bos=True, add_eos=True, add_generation_prompt=True)  # type: ignore[arg-type]


def test_flatten_masks_and_padding(tokenizer: PreTrainedTokenizerBase) -> None:
    long_log = format_message_log(
        CONVERSATION, tokenizer, add_bos=True, add_eos=True, add_generation_prompt=True
    )
    short_log = format_message_log(
        CONVERSATION[1:3], tokenizer, add_bos=True, add_eos=True, add_generation_prompt=True
    )
    batch = message_logs_to_batch([short_log, long_log], pad_token_id=0, train_roles=("assistant",))
    lengths = [message_log_length(short_log), message_log_length(long_log)]
    assert batch["input_lengths"].tolist() == lengths
    assert batch["input_ids"].shape == batch["token_mask"].shape == (2, max(lengths))
    assert batch["input_ids"][0, lengths[0] :].eq(0).all()
    assert batch["token_mask"][0, lengths[0] :].eq(0).all()
    for row, log in enumerate([short_log, long_log]):
        expected_mask = torch.cat(
            [torch.full_like(m["token_ids"], int(m["role"] == "assistant"), dtype=torch.float32) for m in log]
        )
        assert torch.equal(batch["token_mask"][row, : lengths[row]], expected_mask)
        assert torch.equal(batch["input_ids"][row, : lengths[row]], message_log_token_ids(log))
    # The trained tokens are exactly the assistant replies and their end-of-turn token.
    trained = batch["input_ids"][1][batch["token_mask"][1].bool()].tolist()
    assert tokenizer.decode(trained) == "1+2=\\boxed{3}<|eos|>4<|eos|>"


def test_append_and_truncate(tokenizer: PreTrainedTokenizerBase) -> None:
    log = format_message_log(
        CONVERSATION[:2], tokenizer, add_bos=True, add_eos=False, add_generation_prompt=True
    )
    n = message_log_length(log)
    append_message(log, role="assistant", content="3", token_ids=[5, 6])
    assert message_log_length(log) == n + 2 and log[-1]["token_ids"].dtype == torch.long
    with pytest.raises(ValueError, match="1-D"):
        append_message(log, role="assistant", content="x", token_ids=torch.zeros(1, 2))
    cut = truncate_message_log(log, n - 1)
    assert message_log_length(cut) == n - 1 and len(cut) == 2
    assert torch.equal(message_log_token_ids(cut), message_log_token_ids(log)[: n - 1])
    assert message_log_length(truncate_message_log(log, 10_000)) == n + 2
    assert len(truncate_message_log(log, 0)) == 1


def test_sft_processor(tokenizer: PreTrainedTokenizerBase) -> None:
    record = Record(messages=CONVERSATION[1:3], expected_answer="3")
    datum = sft_processor(record, _spec(task_name="sft", system_prompt="Sys."), tokenizer, 128, 7)
    assert datum["idx"] == 7 and datum["task_name"] == "sft" and datum["loss_multiplier"] == 1.0
    assert datum["extra_env_info"] is None
    assert [m["role"] for m in datum["message_log"]] == ["system", "user", "assistant"]
    text = tokenizer.decode(message_log_token_ids(datum["message_log"]).tolist())
    assert text == "<|bos|><|system|>Sys.<|user|>What is 1+2?<|assistant|>1+2=\\boxed{3}<|eos|>"
    assert datum["length"] == len(_ids(tokenizer, text)) == 5 + len("Sys.What is 1+2?1+2=\\boxed{3}")
    with pytest.raises(ValueError, match="sample 3 has no assistant message"):
        sft_processor(Record(messages=CONVERSATION[:2]), _spec(), tokenizer, 128, 3)


def test_math_processor_prompt_and_ground_truth(tokenizer: PreTrainedTokenizerBase) -> None:
    record = Record(messages=CONVERSATION[1:3], expected_answer="3")
    spec = _spec(prompt="Solve: {} Put it in \\boxed{{}}.", system_prompt="Sys.")
    datum = math_processor(record, spec, tokenizer, 128, 2)
    assert datum["task_name"] == "math" and datum["idx"] == 2 and datum["loss_multiplier"] == 1.0
    assert datum["extra_env_info"] == {"ground_truth": "3"}
    text = tokenizer.decode(message_log_token_ids(datum["message_log"]).tolist())
    assert text == "<|bos|><|system|>Sys.<|user|>Solve: What is 1+2? Put it in \\boxed{}.<|assistant|>"
    assert datum["length"] == message_log_length(datum["message_log"])
    assert [m["role"] for m in datum["message_log"]] == ["system", "user"]
    # Without expected_answer the assistant reply after the last user turn is the ground truth.
    fallback = math_processor(Record(messages=CONVERSATION[1:3]), _spec(), tokenizer, 128, 0)
    assert fallback["extra_env_info"] == {"ground_truth": "1+2=\\boxed{3}"}
    with pytest.raises(ValueError, match="sample 5 has no ground truth"):
        math_processor(Record(messages=CONVERSATION[1:2]), _spec(), tokenizer, 128, 5)
    with pytest.raises(ValueError, match="no user message"):
        math_processor(Record(messages=CONVERSATION[:1], expected_answer="1"), _spec(), tokenizer, 128, 0)


def test_math_processor_flags_long_prompts(tokenizer: PreTrainedTokenizerBase) -> None:
    record = Record(messages=[ChatMessage(role="user", content="x" * 100)], expected_answer="1")
    full = math_processor(record, _spec(), tokenizer, 1000, 0)
    assert full["length"] == 100 + 3 and full["loss_multiplier"] == 1.0
    cut = math_processor(record, _spec(), tokenizer, 40, 0)
    assert cut["loss_multiplier"] == 0.0
    assert cut["length"] == message_log_length(cut["message_log"]) == 20
    assert torch.equal(
        message_log_token_ids(cut["message_log"]), message_log_token_ids(full["message_log"])[:20]
    )


def test_task_spec_from_config(tmp_path: pathlib.Path) -> None:
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("Q: {}\n")
    system_file = tmp_path / "s.txt"
    system_file.write_text("You are terse.\n")
    cfg = DataConfig(prompt_file=str(prompt_file), system_prompt_file=str(system_file), add_bos=False)
    spec = TaskDataSpec.from_config(cfg, task_name="math")
    assert spec.apply_prompt("1+1") == "Q: 1+1"
    assert spec.system_prompt == "You are terse."
    assert not spec.add_bos and spec.add_eos
    prompt_file.write_text("no placeholder")
    with pytest.raises(ValueError, match="exactly one '\\{\\}'"):
        TaskDataSpec.from_config(cfg, task_name="math")
    prompt_file.write_text("\\boxed{} {}")
    with pytest.raises(ValueError, match="literal braces"):
        TaskDataSpec.from_config(cfg, task_name="math")
    with pytest.raises(FileNotFoundError, match=r"data\.prompt_file"):
        TaskDataSpec.from_config(DataConfig(prompt_file=str(tmp_path / "nope.txt")), task_name="math")


def test_shipped_cot_prompt() -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    cfg = DataConfig(prompt_file=str(root / "examples" / "prompts" / "cot.txt"))
    prompt = TaskDataSpec.from_config(cfg, task_name="math").apply_prompt("What is 1+2?")
    assert "What is 1+2?" in prompt and "\\boxed{}" in prompt


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer whose merges cross turn boundaries, unlike the character-level one."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["user\nWhat is 12+7?\n", "assistant\nThe answer is 19.\n", "system\nYou are helpful.\n"] * 20
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Renders a turn differently once another follows it (as templates that drop past reasoning do), and
# has no separator tokens, so BPE merges run across turn boundaries.
REWRITING = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if not loop.last %} (earlier){% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.mark.parametrize("template", [CHATML, REWRITING, "default"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_message_log_matches_whole_rendering_with_bpe(
    bpe_tokenizer: PreTrainedTokenizerFast, template: str, add_generation_prompt: bool
) -> None:
    original = bpe_tokenizer.chat_template
    bpe_tokenizer.chat_template = resolve_chat_template(template)
    conversation = [{"role": m["role"], "content": m["content"]} for m in CONVERSATION]
    try:
        full_text = bpe_tokenizer.apply_chat_template(conversation, tokenize=False)
        assert isinstance(full_text, str)
        full_ids = _ids(bpe_tokenizer, full_text)
        for add_eos in (False, True):
            log = format_message_log(
                CONVERSATION,
                bpe_tokenizer,
                add_bos=True,
                add_eos=add_eos,
                add_generation_prompt=add_generation_prompt,
            )
            ids = message_log_token_ids(log).tolist()
            assert all(m["token_ids"].numel() > 0 for m in log)
            # ChatML closes every turn with EOS then a newline: add_eos must not add a second one.
            if add_eos and template != CHATML:
                assert ids == [*full_ids, bpe_tokenizer.eos_token_id]
            else:
                assert ids == full_ids
    finally:
        bpe_tokenizer.chat_template = original


TOOLS = [
    {"type": "function", "function": {"name": "calculator", "parameters": {"properties": {"expression": {}}}}}
]
TOOL_CONVERSATION = [
    ChatMessage(role="user", content="What is 12*34?"),
    ChatMessage(role="assistant", content='<tool_call>{"name": "calculator"}</tool_call>'),
    ChatMessage(role="tool", content="408"),
    ChatMessage(role="tool", content="408"),
    ChatMessage(role="assistant", content="\\boxed{408}"),
]


def test_tool_conversations_declare_their_tools_and_end_tool_turns_with_the_prompt(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    record = Record(messages=TOOL_CONVERSATION, tools=TOOLS)
    log = sft_processor(record, _spec(), tokenizer, 256, 0)["message_log"]
    assert [m["content"] for m in log] == [
        "<|bos|><|system|><tools>calculator(expression)</tools><|user|>What is 12*34?<|assistant|>",
        '<tool_call>{"name": "calculator"}</tool_call><|eos|>',
        "<|user|><tool_response>408</tool_response>",
        # A run of tool messages is one user turn; its last hands the turn back to the assistant.
        "<tool_response>408</tool_response><|assistant|>",
        "\\boxed{408}<|eos|>",
    ]
    # The task's own tools declare them when the record has none; a record's replace them.
    prompt = math_processor(
        Record(messages=TOOL_CONVERSATION[:1], expected_answer="408"),
        _spec(tools=tuple(TOOLS)),
        tokenizer,
        256,
        0,
    )
    assert prompt["message_log"][0]["content"] == log[0]["content"]
    assert (
        "<tools>"
        not in format_message_log(
            TOOL_CONVERSATION[:1], tokenizer, add_bos=True, add_eos=False, add_generation_prompt=True
        )[0]["content"]
    )
