"""The shared-prompt forward (``policy.shared_prefix``): rows that share a prompt compute it once.

GRPO samples G responses per prompt, so a batch holds every prompt G times. Here the rows of one prompt run
as ONE segment, ``[prompt, response_1, ..., response_G]``, with position ids 0..P-1 over the prompt and
P..P+L-1 again for every response, so every linear layer, norm and MLP sees each prompt token once; the
segments of a micro-batch are packed end to end in one row, with no padding between them. Attention is
the only part that mixes tokens: :func:`shared_prefix_attention` (a Hugging Face attention implementation)
runs it in blocks, the prompt causally over itself and each response over the whole prompt plus its own
earlier tokens, which is exactly what that response sees in its own unshared row. So the logits of every
row, read back with :meth:`SharedPrefixRows.unpack`, are those of the unshared forward, and their gradients
sum into the shared prompt's activations as they would through G copies (as in the Prefix Grouper method).
Attention is never computed densely over a segment or the packed row: its cost stays that of the unshared
rows (each response against prompt + itself), while the rest of the model saves (G - 1) x P tokens per
group and all padding.

Groups are found in the data: rows whose tokens before their first trained token (``token_mask``) are
identical. Rows without a partner are groups of one, laid out as their ordinary row.

Tensor legend: B = rows (1 for the packed row), T = tokens, G = groups, L = packed-row length (``_1L``) or
longest response (``_RL``), S = sequence, H = heads, D = head dim, P = longest prompt, K = P + longest
response, R = responses (rows with at least one response token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl.models.policy.utils import round_up

ATTENTION = "nemo_rl_shared_prefix"
"""The Hugging Face attention implementation name of :func:`shared_prefix_attention`."""


def prompt_lengths(token_mask_BT: torch.Tensor, input_lengths_B: torch.Tensor) -> list[int]:
    """Each row's prompt length: the position of its first trained token (``token_mask``), or its whole length
    when it has none (a row with no response is all prompt)."""
    lengths_B = input_lengths_B.to(token_mask_BT.device)
    trained_BT = token_mask_BT > 0
    first_B = torch.where(trained_BT.any(dim=1), trained_BT.int().argmax(dim=1), lengths_B)
    return [int(n) for n in torch.minimum(first_B, lengths_B).tolist()]


def shared_prefix_groups(input_ids_BT: torch.Tensor, prompt_lengths_B: list[int]) -> list[list[int]]:
    """Rows grouped by identical prompts (same length, same tokens), in order of first appearance.

    A row with an empty prompt, or whose prompt no other row has, is a group of its own.
    """
    ids = input_ids_BT.cpu()
    groups: dict[tuple[int, ...] | int, list[int]] = {}
    for row, length in enumerate(prompt_lengths_B):
        key: tuple[int, ...] | int = tuple(ids[row, :length].tolist()) if length > 0 else -1 - row
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def identical_rows(mb: Any) -> tuple[list[int] | None, torch.Tensor]:
    """The first row of each set of rows identical in full (tokens up to their length, length, trained
    tokens), and for every row the position of its set's first row among them: ``(None, ...)`` when no two
    rows are identical. ``mb`` is a micro-batch with ``input_ids``, ``input_lengths`` and ``token_mask``."""
    ids_BT, lengths = mb["input_ids"].cpu(), mb["input_lengths"].tolist()
    mask_BT = mb["token_mask"].cpu() if "token_mask" in mb else None
    first: dict[tuple[Any, ...], int] = {}
    copies: list[int] = []
    for row, length in enumerate(lengths):
        key = (
            length,
            tuple(ids_BT[row, :length].tolist()),
            tuple(mask_BT[row, :length].tolist()) if mask_BT is not None else (),
        )
        copies.append(first.setdefault(key, len(first)))
    if len(first) == len(lengths):
        return None, torch.arange(len(lengths))
    unique = [0] * len(first)
    for row in reversed(range(len(lengths))):  # each set's first row
        unique[copies[row]] = row
    return unique, torch.tensor(copies)


def shared_prefix_units(
    groups: list[list[int]], input_lengths: list[int], prompt_lengths_B: list[int], max_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """``(units, unit lengths)``: ``groups`` cut so that each unit's segment (its prompt once, then every
    row's response) holds at most ``max_tokens`` tokens; a row longer than that is a unit of its own."""
    units: list[list[int]] = []
    lengths: list[int] = []
    for group in groups:
        prompt = prompt_lengths_B[group[0]]
        current: list[int] = []
        current_len = prompt
        for row in group:
            response = input_lengths[row] - prompt
            if current and current_len + response > max_tokens:
                units.append(current)
                lengths.append(current_len)
                current, current_len = [], prompt
            current.append(row)
            current_len += response
        units.append(current)
        lengths.append(current_len)
    return units, lengths


@dataclass(frozen=True)
class SharedPrefixLayout:
    """Where :func:`shared_prefix_attention` reads its blocks in the packed row (slots 0..L-1)."""

    prompt_index_GP: torch.Tensor
    """Slot of each group's prompt token (the row's own slots past its prompt: masked)."""
    prompt_allowed_G1PP: torch.Tensor
    """bool: prompt query p may attend prompt key p' (causal, within the prompt; padding attends itself)."""
    response_index_RL: torch.Tensor
    """Slot of each response token (the row's last slot past the response: masked)."""
    response_kv_index_RK: torch.Tensor
    """Keys of each response: its group's prompt slots, then its own (K = P + L)."""
    response_allowed_R1LK: torch.Tensor
    """bool: response query l may attend the whole prompt and its own response up to l."""
    prompt_slots: torch.Tensor
    """Flattened slots of the real prompt tokens (where the prompt blocks' outputs go)."""
    prompt_valid_GP: torch.Tensor
    prompt_valid_flat: torch.Tensor
    """Positions of the real prompt tokens in the flattened [G * P] prompt blocks."""
    response_slots: torch.Tensor
    """Flattened slots of the real response tokens."""
    response_valid_RL: torch.Tensor
    response_valid_flat: torch.Tensor
    """Positions of the real response tokens in the flattened [R * L] response blocks."""


@dataclass(frozen=True)
class SharedPrefixRows:
    """Rows that share prompts laid out as one packed row ``[1, L]``: each group's prompt once, then each of
    its rows' responses, group after group, and the way back to ``[B, T]``.

    Row ``b``'s position ``t`` is its group's prompt slot ``t`` for ``t < P`` (so the last prompt position,
    which predicts the first response token, is shared too) and its response's slot beyond. Attention never
    crosses a group (:func:`shared_prefix_attention` reads only a group's own blocks), so the groups pack end
    to end with no padding between them.
    """

    input_ids_1L: torch.Tensor
    position_ids_1L: torch.Tensor
    layout: SharedPrefixLayout
    index_BT: torch.Tensor
    """Slot in the packed row of each row's token (0 where the row is padding)."""
    valid_BT: torch.Tensor

    @staticmethod
    def build(
        input_ids_BT: torch.Tensor,
        input_lengths_B: torch.Tensor,
        prompt_lengths_B: list[int],
        groups: list[list[int]],
        multiple: int,
    ) -> SharedPrefixRows:
        """Lay out ``groups`` (row indices sharing a prompt of ``prompt_lengths_B[row]`` tokens) of the rows'
        first ``input_lengths_B[b]`` tokens; L is their total rounded up to ``multiple``."""
        device = input_ids_BT.device
        num_rows, seq_len = input_ids_BT.shape
        lengths = [int(n) for n in input_lengths_B.tolist()]
        responses = [lengths[b] - prompt_lengths_B[b] for b in range(num_rows)]
        group_of = [0] * num_rows
        prompt_start_of = [0] * num_rows  # the slot where the row's group (its prompt) starts
        start_of = [0] * num_rows  # the slot where the row's response starts
        group_starts, group_prompts = [], []
        offset = 0
        for g, group in enumerate(groups):
            group_starts.append(offset)
            group_prompts.append(prompt_lengths_B[group[0]])
            prompt_start = offset
            offset += group_prompts[-1]
            for row in group:
                group_of[row], prompt_start_of[row], start_of[row] = g, prompt_start, offset
                offset += responses[row]
        width = round_up(max(offset, 1), multiple)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        t_T = torch.arange(seq_len, device=device)
        lengths_B, prompt_B = tensor(lengths), tensor(prompt_lengths_B)
        valid_BT = t_T[None, :] < lengths_B[:, None]
        in_prompt_BT = t_T[None, :] < prompt_B[:, None]
        prompt_slot_BT = tensor(prompt_start_of)[:, None] + t_T[None, :]
        response_slot_BT = tensor(start_of)[:, None] + t_T[None, :] - prompt_B[:, None]
        index_BT = torch.where(valid_BT, torch.where(in_prompt_BT, prompt_slot_BT, response_slot_BT), 0)
        slots = index_BT[valid_BT]
        input_ids_1L = input_ids_BT.new_zeros(1, width)
        input_ids_1L[0, slots] = input_ids_BT[valid_BT]
        # Slots past the last group (rounding) keep their own index as position; nothing attends them.
        position_ids_1L = torch.arange(width, device=device)[None, :].clone()
        position_ids_1L[0, slots] = t_T.expand(num_rows, -1)[valid_BT]

        layout = _block_layout(group_prompts, group_starts, responses, group_of, start_of, width, device)
        return SharedPrefixRows(input_ids_1L, position_ids_1L, layout, index_BT, valid_BT)

    def unpack(self, values_1L: torch.Tensor) -> torch.Tensor:
        """``[1, L, ...]`` per-token values back to ``[B, T, ...]`` (zeros at the rows' padding)."""
        values_BT = _take_rows(values_1L[0], self.index_BT)
        mask = self.valid_BT.reshape(*self.valid_BT.shape, *([1] * (values_BT.ndim - 2)))
        return torch.where(mask, values_BT, torch.zeros((), dtype=values_BT.dtype, device=values_BT.device))


def _block_layout(
    group_prompts: list[int],
    group_starts: list[int],
    responses: list[int],
    group_of: list[int],
    start_of: list[int],
    width: int,
    device: torch.device,
) -> SharedPrefixLayout:
    """The attention blocks of a packed row: each group's prompt causally over itself, each response over
    its group's prompt and causally over itself (see :class:`SharedPrefixLayout`)."""
    num_rows = len(responses)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    # Prompt blocks: each group's prompt, causally over itself.
    max_prompt = max(max(group_prompts), 1)
    p_P = torch.arange(max_prompt, device=device)
    prompt_valid_GP = p_P[None, :] < tensor(group_prompts)[:, None]
    prompt_index_GP = (tensor(group_starts)[:, None] + p_P[None, :]).clamp(max=width - 1)
    causal_PP = p_P[None, :] <= p_P[:, None]
    # A padding query attends itself only (an all-masked row would be NaN in the softmax and its backward).
    prompt_allowed_G1PP = (causal_PP & prompt_valid_GP[:, None, :]) | torch.eye(
        max_prompt, dtype=torch.bool, device=device
    )
    # Response blocks: each response over its group's prompt and causally over itself.
    rows_R = [b for b in range(num_rows) if responses[b] > 0]
    max_response = max([responses[b] for b in rows_R], default=1)
    l_L = torch.arange(max_response, device=device)
    response_valid_RL = l_L[None, :] < tensor([responses[b] for b in rows_R])[:, None]
    groups_R = tensor([group_of[b] for b in rows_R])
    starts_R = tensor([start_of[b] for b in rows_R])
    response_index_RL = torch.where(response_valid_RL, starts_R[:, None] + l_L[None, :], starts_R[:, None])
    response_kv_index_RK = torch.cat([prompt_index_GP[groups_R], response_index_RL], dim=1)
    causal_LL = l_L[None, :] <= l_L[:, None]
    response_allowed_R1LK = torch.cat(
        [
            prompt_valid_GP[groups_R][:, None, :].expand(-1, max_response, -1),
            causal_LL[None] & response_valid_RL[:, None, :],
        ],
        dim=2,
    )[:, None]
    return SharedPrefixLayout(
        prompt_index_GP=prompt_index_GP,
        prompt_allowed_G1PP=prompt_allowed_G1PP[:, None],
        response_index_RL=response_index_RL,
        response_kv_index_RK=response_kv_index_RK,
        response_allowed_R1LK=response_allowed_R1LK,
        prompt_slots=prompt_index_GP[prompt_valid_GP],
        prompt_valid_GP=prompt_valid_GP,
        prompt_valid_flat=prompt_valid_GP.reshape(-1).nonzero().squeeze(1),
        response_slots=response_index_RL[response_valid_RL],
        response_valid_RL=response_valid_RL,
        response_valid_flat=response_valid_RL.reshape(-1).nonzero().squeeze(1),
    )


def _take_rows(x_N: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x_N[index]`` (rows of ``x_N`` picked by an index tensor of any shape) by ``index_select``: the same
    values, and a backward (``index_add``) that is cheaper on the CPU than advanced indexing's accumulating
    ``index_put``."""
    return x_N.index_select(0, index.reshape(-1)).view(*index.shape, *x_N.shape[1:])


def shared_prefix_attention(
    module: torch.nn.Module,
    query_BHSD: torch.Tensor,
    key_BHSD: torch.Tensor,
    value_BHSD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    shared_prefix_layout: SharedPrefixLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A Hugging Face attention implementation: blockwise attention over group rows given
    ``shared_prefix_layout`` (the model's forward keyword), else plain sdpa attention.

    Returns ``[1, L, H, D]`` as Hugging Face's implementations do; slots past the last group get zeros.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = shared_prefix_layout
    if layout is None:
        return sdpa_attention_forward(
            module,
            query_BHSD,
            key_BHSD,
            value_BHSD,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
    return _blockwise_attention(query_BHSD, key_BHSD, value_BHSD, layout, dropout, scaling), None


def _blockwise_attention(
    query_BHSD: torch.Tensor,
    key_BHSD: torch.Tensor,
    value_BHSD: torch.Tensor,
    layout: SharedPrefixLayout,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of ``layout``'s groups, ``[1, L, H, D]``: each prompt once over itself, then each response
    over its prompt and itself."""
    batch, num_heads, width, head_dim = query_BHSD.shape
    num_kv_heads = key_BHSD.shape[1]

    def flat(x_BHSD: torch.Tensor) -> torch.Tensor:
        return x_BHSD.transpose(1, 2).reshape(batch * width, x_BHSD.shape[1], head_dim)

    q, k, v = flat(query_BHSD), flat(key_BHSD), flat(value_BHSD)

    def block(q_index: torch.Tensor, kv_index: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        # Grouped-query attention reads each key/value head for its query heads (enable_gqa) instead of
        # materialising the repeated heads and gathering every copy.
        out_NHWD = torch.nn.functional.scaled_dot_product_attention(
            _take_rows(q, q_index).transpose(1, 2),
            _take_rows(k, kv_index).transpose(1, 2),
            _take_rows(v, kv_index).transpose(1, 2),
            attn_mask=allowed,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=num_kv_heads != num_heads,
        )
        return out_NHWD.transpose(1, 2).reshape(-1, num_heads, head_dim)

    prompt_out = block(layout.prompt_index_GP, layout.prompt_index_GP, layout.prompt_allowed_G1PP)
    out = q.new_zeros(q.shape).index_copy(
        0, layout.prompt_slots, prompt_out.index_select(0, layout.prompt_valid_flat)
    )
    if layout.response_slots.numel():
        response_out = block(
            layout.response_index_RL, layout.response_kv_index_RK, layout.response_allowed_R1LK
        )
        out = out.index_copy(
            0, layout.response_slots, response_out.index_select(0, layout.response_valid_flat)
        )
    return out.reshape(batch, width, num_heads, head_dim)


def use_shared_prefix_attention(model: torch.nn.Module) -> None:
    """Make ``model`` (a Hugging Face model with sdpa attention) run :func:`shared_prefix_attention`: plain sdpa
    for ordinary forwards (the same masks and kernels), blockwise for forwards given a layout."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config: Any = getattr(model, "config", None)
    if config is None:
        raise ValueError("policy.shared_prefix.enabled=true needs a Hugging Face model with a config")
    if config._attn_implementation == ATTENTION:
        return
    sliding = [kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"]
    if config._attn_implementation != "sdpa" or sliding:
        raise ValueError(
            "policy.shared_prefix.enabled=true needs full attention through the sdpa implementation, but this "
            f"model uses {config._attn_implementation!r} attention"
            + (f" and {sorted(set(sliding))} layers" if sliding else "")
            + ": set policy.shared_prefix.enabled=false"
        )
    AttentionInterface.register(ATTENTION, shared_prefix_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    config._attn_implementation = ATTENTION
