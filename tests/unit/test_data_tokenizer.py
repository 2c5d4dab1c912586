"""Loading tokenizers through get_tokenizer: saved class honoured, pad token, chat-template overrides."""

from __future__ import annotations

import json
import pathlib

import pytest
from transformers import PreTrainedTokenizerFast, Qwen2Config

from nemo_rl.config.policy import PolicyConfig, TokenizerConfig
from nemo_rl.data.tiny import build_tiny_tokenizer
from nemo_rl.models.tokenizer import DEFAULT_CHAT_TEMPLATE, get_policy_tokenizer, get_tokenizer

TEXT = "What is 12 + 7?\n  \\boxed{19}\tok"


@pytest.fixture
def tokenizer_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    build_tiny_tokenizer(tmp_path)
    # A qwen2 config.json next to the tokenizer, as in a model checkpoint: AutoTokenizer then forces
    # the Qwen2 tokenizer class.
    Qwen2Config(vocab_size=104, hidden_size=8, num_hidden_layers=1, num_attention_heads=1).save_pretrained(
        tmp_path
    )
    return tmp_path


def _load(path: pathlib.Path, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    tokenizer = get_tokenizer(
        TokenizerConfig(name=str(path), chat_template=chat_template), model_name=None, trust_remote_code=False
    )
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    return tokenizer


def test_saved_tokenizers_backend_class_is_honoured(tokenizer_dir: pathlib.Path) -> None:
    saved = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    tokenizer = _load(tokenizer_dir)
    assert type(tokenizer).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT)
    assert tokenizer.decode(ids) == TEXT


def test_name_falls_back_to_model_name(tokenizer_dir: pathlib.Path) -> None:
    tokenizer = get_tokenizer(TokenizerConfig(), model_name=str(tokenizer_dir), trust_remote_code=False)
    assert tokenizer.decode(tokenizer(TEXT, add_special_tokens=False)["input_ids"]) == TEXT
    with pytest.raises(ValueError, match=r"policy\.tokenizer\.name or policy\.model_name"):
        get_tokenizer(TokenizerConfig(), model_name=None, trust_remote_code=False)


def test_policy_helper(tokenizer_dir: pathlib.Path) -> None:
    policy = PolicyConfig(model_name=str(tokenizer_dir), tokenizer=TokenizerConfig(chat_template="default"))
    tokenizer = get_policy_tokenizer(policy)
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE


def test_missing_pad_token_becomes_eos(tokenizer_dir: pathlib.Path) -> None:
    config_path = tokenizer_dir / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    del saved["pad_token"]
    config_path.write_text(json.dumps(saved))
    tokenizer = _load(tokenizer_dir)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|eos|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id


def test_default_chat_template_renders_role_lines(tokenizer_dir: pathlib.Path) -> None:
    tokenizer = _load(tokenizer_dir, chat_template="default")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "user: hi\nassistant: hello\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "user: hi\nassistant: "


def test_chat_template_from_text_and_file(tokenizer_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert _load(tokenizer_dir, template).apply_chat_template(messages, tokenize=False) == "[a][b]"
    template_file = tmp_path / "t.jinja"
    template_file.write_text(template)
    assert _load(tokenizer_dir, str(template_file)).apply_chat_template(messages, tokenize=False) == "[a][b]"
    with pytest.raises(FileNotFoundError, match=r"missing\.jinja"):
        _load(tokenizer_dir, str(tmp_path / "missing.jinja"))


def test_chat_template_kwargs_reach_every_call(tokenizer_dir: pathlib.Path) -> None:
    # NeMo RL's policy.tokenizer.chat_template_kwargs (e.g. enable_thinking); a call's own argument wins.
    cfg = TokenizerConfig(
        name=str(tokenizer_dir),
        chat_template="{{ messages[0]['content'] }}{% if think %}<think>{% endif %}",
        chat_template_kwargs={"think": True},
    )
    tokenizer = get_tokenizer(cfg, model_name=None, trust_remote_code=False)
    messages = [{"role": "user", "content": "a"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "a<think>"
    assert tokenizer.apply_chat_template(messages, tokenize=False, think=False) == "a"
