"""Message logs: conversations tokenized turn by turn, and their flattening into padded batches.

Legend: B = samples in the batch, T = padded sequence length.

Why turn by turn: training needs to know which tokens belong to which role (loss only on the assistant's),
yet the tokens must be exactly those of the whole conversation rendered by the chat template, or the model
trains on a text it never sees at generation time. :func:`format_message_log` therefore tokenizes the
rendering of the whole conversation once, and cuts it at the points where the renderings of its prefixes
(first message, first two messages...) stop agreeing with it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.data.interfaces import ChatMessage, LLMMessage, MessageLog
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

_PROMPTING_ROLES = ("user", "tool")
"""Roles whose turn hands the conversation back to the assistant (``add_generation_prompt``)."""


def format_message_log(
    messages: Sequence[ChatMessage],
    tokenizer: PreTrainedTokenizerBase,
    *,
    add_bos: bool,
    add_eos: bool,
    add_generation_prompt: bool,
    tools: Sequence[dict[str, Any]] = (),
) -> MessageLog:
    """Tokenize ``messages`` with the tokenizer's chat template, one :class:`LLMMessage` per turn.

    Concatenating the ``token_ids`` of the result gives the tokenization of the whole rendered conversation
    (plus BOS / EOS where ``add_bos`` / ``add_eos`` ask for them and the template does not put them).

    Args:
        messages: The conversation, in OpenAI format.
        tokenizer: A tokenizer with a chat template.
        add_bos: Put the BOS token first when the rendering does not start with it.
        add_eos: Put the EOS token last when the last turn has none (the template did not close it).
        add_generation_prompt: Render the assistant header after every user or tool turn, as part of that
            turn (for a conversation ending with one: the prompt to generate from).
        tools: JSON schemas of the tools the conversation may call, passed to the template as ``tools=``
            (empty: none; the Qwen templates then render no tools section).
    """
    _check_conversation(messages, tokenizer)
    render = _ChatRendering(messages, tokenizer, tools, add_generation_prompt)
    chunks = _turn_chunks(render)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    first_id = next((chunk[0] for chunk in chunks if chunk), None)
    if add_bos and bos is not None and first_id != bos:
        chunks[0] = [bos, *chunks[0]]
    # A template that closes the turn with EOS and then a newline (ChatML) has already ended it.
    if add_eos and eos is not None and eos not in chunks[-1]:
        chunks[-1] = [*chunks[-1], eos]

    message_log: MessageLog = []
    for message, chunk in zip(messages, chunks, strict=True):
        content = tokenizer.decode(chunk, skip_special_tokens=False)
        assert isinstance(content, str)
        message_log.append(
            LLMMessage(role=message["role"], content=content, token_ids=torch.tensor(chunk, dtype=torch.long))
        )
    return message_log


def _check_conversation(messages: Sequence[ChatMessage], tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse an empty conversation, a message without role or content, and a tokenizer without a template."""
    if not messages:
        raise ValueError("cannot format an empty conversation: give at least one message")
    if tokenizer.chat_template is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path} has no chat template: set policy.tokenizer.chat_template "
            "(a Jinja template, a path to a .jinja file, or 'default' for plain 'role: content' lines)"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"message {i} of the conversation needs 'role' and 'content', got {message!r}")


@dataclass(frozen=True)
class _ChatRendering:
    """Renders prefixes of one conversation with the chat template and tokenizes them."""

    messages: Sequence[ChatMessage]
    tokenizer: PreTrainedTokenizerBase
    tools: Sequence[dict[str, Any]]
    add_generation_prompt: bool

    def ids(self, num_messages: int) -> list[int]:
        """The token ids of the first ``num_messages`` messages rendered (the generation prompt after a
        user or tool turn when ``add_generation_prompt``)."""
        prefix = [{"role": m["role"], "content": m["content"]} for m in self.messages[:num_messages]]
        text = self.tokenizer.apply_chat_template(
            prefix,
            tools=list(self.tools) or None,
            tokenize=False,
            add_generation_prompt=self.add_generation_prompt and prefix[-1]["role"] in _PROMPTING_ROLES,
        )
        assert isinstance(text, str)
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids


def _turn_chunks(render: _ChatRendering) -> list[list[int]]:
    """The whole conversation's token ids cut into one chunk per message: each cut where the rendering of
    the messages so far stops agreeing with the whole rendering."""
    num_messages = len(render.messages)
    full_ids = render.ids(num_messages)
    ends = []
    end = 0
    for i in range(1, num_messages):
        # The longest common prefix, not len(prefix_ids): a template may render a turn differently once
        # another follows it, and the tokens it disagrees on belong to the next turn.
        end = max(end, _common_prefix_length(render.ids(i), full_ids))
        ends.append(end)
    ends.append(len(full_ids))
    return [full_ids[start:stop] for start, stop in zip([0, *ends[:-1]], ends, strict=True)]


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def append_message(
    message_log: MessageLog, *, role: str, content: str, token_ids: torch.Tensor | Sequence[int]
) -> MessageLog:
    """Append one turn (e.g. a generated response or an environment observation) and return the log.

    The log is changed in place; copy it first (``copy.deepcopy``) when it is shared, e.g. between the
    repeated samples of one prompt.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.ndim != 1:
        raise ValueError(f"token_ids of a message must be 1-D, got shape {tuple(ids.shape)}")
    message_log.append(LLMMessage(role=role, content=content, token_ids=ids))
    return message_log


def message_log_length(message_log: MessageLog) -> int:
    """Total number of tokens in the log."""
    return sum(int(m["token_ids"].numel()) for m in message_log)


def message_log_token_ids(message_log: MessageLog) -> torch.Tensor:
    """The log's token ids concatenated into one 1-D long tensor."""
    if not message_log:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([m["token_ids"].to(torch.long) for m in message_log])


def truncate_message_log(message_log: MessageLog, max_tokens: int) -> MessageLog:
    """The first ``max_tokens`` tokens of the log, as a new log (messages cut or dropped at the end).

    The first message is always kept, even if it ends up with no tokens, so the log is never empty.
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    truncated: MessageLog = []
    budget = max_tokens
    for message in message_log:
        if budget <= 0 and truncated:
            break
        ids = message["token_ids"][:budget]
        cut = ids.numel() < message["token_ids"].numel()
        truncated.append(
            LLMMessage(
                role=message["role"],
                # Past the cut the text no longer matches the ids; keep the full text only for whole messages.
                content=message["content"] if not cut else "",
                token_ids=ids,
            )
        )
        budget -= int(ids.numel())
    return truncated


def flat_token_positions(lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, column) of every token of a right-padded ``[B, T]`` batch whose rows hold ``lengths``
    tokens, in row-major order: index a padded tensor with them to scatter the rows' concatenated tokens."""
    lengths_B = torch.tensor(lengths, dtype=torch.long)
    rows_N = torch.repeat_interleave(torch.arange(len(lengths)), lengths_B)
    starts_B = torch.cumsum(lengths_B, 0) - lengths_B
    cols_N = torch.arange(int(lengths_B.sum())) - starts_B.repeat_interleave(lengths_B)
    return rows_N, cols_N


def message_logs_to_batch(
    message_logs: Sequence[MessageLog],
    *,
    pad_token_id: int,
    train_roles: Collection[str],
) -> BatchedDataDict[Any]:
    """Flatten message logs into right-padded tensors.

    Returns a BatchedDataDict with ``input_ids`` [B, T] long (padded with ``pad_token_id``),
    ``input_lengths`` [B] long and ``token_mask`` [B, T] float (1 on the tokens of messages whose role is
    in ``train_roles``, 0 elsewhere and on padding).
    """
    if not message_logs:
        raise ValueError("cannot flatten an empty batch of message logs")
    lengths = [message_log_length(log) for log in message_logs]
    max_length = max(lengths)
    input_ids_BT = torch.full((len(message_logs), max_length), pad_token_id, dtype=torch.long)
    token_mask_BT = torch.zeros((len(message_logs), max_length), dtype=torch.float32)
    messages = [message for log in message_logs for message in log]
    if messages:
        # One scatter for the whole batch instead of two slice assignments per message.
        rows_N, cols_N = flat_token_positions(lengths)
        input_ids_BT[rows_N, cols_N] = torch.cat([m["token_ids"].to(torch.long) for m in messages])
        trained_M = torch.tensor([m["role"] in train_roles for m in messages], dtype=torch.float32)
        num_tokens_M = torch.tensor([int(m["token_ids"].numel()) for m in messages], dtype=torch.long)
        token_mask_BT[rows_N, cols_N] = trained_M.repeat_interleave(num_tokens_M)
    return BatchedDataDict(
        input_ids=input_ids_BT,
        input_lengths=torch.tensor(lengths, dtype=torch.long),
        token_mask=token_mask_BT,
    )
