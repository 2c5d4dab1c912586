"""Loading the tokenizer of a policy, with its chat template and a pad token.

transformers 5's ``AutoTokenizer`` picks the tokenizer class from the *model* type for some families (for a
``qwen2`` checkpoint it always builds ``Qwen2Tokenizer``), which rebuilds the tokenizer with that family's
pre-tokenizer and silently changes how a custom tokenizer splits text (the tiny character-level tokenizer
loses its spaces). When the checkpoint saved a plain ``tokenizers`` backend (``tokenizer_class`` is
``TokenizersBackend`` / ``PreTrainedTokenizerFast``), its ``tokenizer.json`` is the complete definition, so
:func:`get_tokenizer` loads it with that class directly. Any other class is left to ``AutoTokenizer``, which
knows the hub checkpoints whose saved class is wrong.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig, TokenizerConfig
from nemo_rl.config.sources import check_policy_sources
from nemo_rl.utils.files import existing_file, read_utf8

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""What ``chat_template: default`` means: one plain ``role: content`` line per message."""

# Class names under which transformers saves a tokenizer fully described by its tokenizer.json.
_GENERIC_FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def get_tokenizer(
    cfg: TokenizerConfig, *, model_name: str | None, trust_remote_code: bool
) -> PreTrainedTokenizerBase:
    """Load the tokenizer named by ``cfg.name`` (or ``model_name``), apply the chat-template override and its
    ``chat_template_kwargs``, and make sure it has a pad token (the EOS token when the checkpoint defines none).

    Args:
        cfg: The ``policy.tokenizer`` section.
        model_name: Fallback when ``cfg.name`` is ``None`` (normally ``policy.model_name``).
        trust_remote_code: Allow the tokenizer's repository to run its own code.
    """
    name = cfg.name or model_name
    if name is None:
        raise ValueError("no tokenizer to load: set policy.tokenizer.name or policy.model_name")
    tokenizer = _load(name, trust_remote_code=trust_remote_code)
    if cfg.chat_template is not None:
        tokenizer.chat_template = resolve_chat_template(cfg.chat_template)
    if cfg.chat_template_kwargs:
        # Every apply_chat_template call (data processors, rollouts) sees the template variables, as in NeMo
        # RL; a call's own keyword arguments still win.
        tokenizer.apply_chat_template = functools.partial(  # type: ignore[method-assign]
            tokenizer.apply_chat_template, **cfg.chat_template_kwargs
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer {name} defines neither a pad token nor an EOS token: add one to its "
                'tokenizer_config.json (e.g. "pad_token": "<pad>")'
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def get_policy_tokenizer(policy: PolicyConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of a ``policy`` section (:func:`get_tokenizer` with the policy's model and trust flag).

    Scripts call it before starting Ray, so it first checks that ``policy.model_name`` (and
    ``policy.tokenizer.name``) can be loaded: see :func:`nemo_rl.config.sources.check_model_source`.
    """
    check_policy_sources(policy)
    key, name = "policy.tokenizer.name", policy.tokenizer.name
    if name is None:
        key, name = "policy.model_name", policy.model_name
    try:
        return get_tokenizer(
            policy.tokenizer, model_name=policy.model_name, trust_remote_code=policy.trust_remote_code
        )
    except (OSError, ValueError) as err:
        # transformers' error says whether the hub could not be reached, the name is unknown or the folder
        # lacks tokenizer files; its first line is enough.
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"{key}={name}: the tokenizer cannot be loaded ({first_line}); give a local folder or a hub name "
            "that this machine can download (or that is in the Hugging Face cache)"
        ) from err


def require_pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id batches are right-padded with; a tokenizer without a pad token is a user error."""
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token; load it with nemo_rl.models.tokenizer.get_tokenizer"
        )
    return int(tokenizer.pad_token_id)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, checkpoint_dir: pathlib.Path | None) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS plus the model's ``generation_config.json`` EOS list."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if checkpoint_dir is not None and (checkpoint_dir / "generation_config.json").exists():
        from transformers import GenerationConfig

        extra = GenerationConfig.from_pretrained(checkpoint_dir).eos_token_id
        ids.extend([extra] if isinstance(extra, int) else list(extra or []))
    return sorted(set(ids))


def resolve_chat_template(chat_template: str) -> str:
    """The Jinja text of a ``chat_template`` setting: ``"default"``, a path to a ``.jinja`` file, or Jinja."""
    if chat_template == "default":
        return DEFAULT_CHAT_TEMPLATE
    if chat_template.endswith(".jinja"):
        return read_utf8(
            existing_file(chat_template, key="policy.tokenizer.chat_template", kind=".jinja file")
        )
    return chat_template


def _load(name: str, *, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    # transformers' auto classes import its model-parallel and torch.compile stacks (seconds of CPU), so
    # they are imported only when needed: a local plain tokenizers backend loads without them.
    tokenizer_config = _local_tokenizer_config(name)
    if tokenizer_config is None:
        from transformers.models.auto.tokenization_auto import get_tokenizer_config

        tokenizer_config = get_tokenizer_config(name)
    saved_class = tokenizer_config.get("tokenizer_class")
    # Remote code decides its own class; only a plain tokenizers backend is loaded around AutoTokenizer.
    if saved_class in _GENERIC_FAST_CLASSES and "auto_map" not in tokenizer_config:
        tokenizer: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(name)
        return tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    return tokenizer


def _local_tokenizer_config(name: str) -> dict[str, Any] | None:
    """``tokenizer_config.json`` of a local folder (``None`` when ``name`` is no folder with one)."""
    path = pathlib.Path(name).expanduser() / "tokenizer_config.json"
    if not path.is_file():
        return None
    config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return config
