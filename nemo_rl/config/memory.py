"""The formulas of the memory plan: bytes one worker's device holds, term by term.

Each public function computes one term of :mod:`nemo_rl.config.memory_plan` for one rank, from the model's
architecture (:class:`~nemo_rl.config.model_arch.ModelArch`) and the parallel layout. Parameters are
listed shape by shape (:func:`dtensor_parameters`, :func:`megatron_parameters`) and divided exactly as the
workers divide them: tensor parallelism splits one dim of a weight (``torch.chunk``: the first ranks get the
larger pieces), FSDP2 then splits dim 0 of what is left over the data-parallel ranks, pipeline parallelism
gives each stage its layers. Sizes are those of rank 0, the most loaded rank.

The weights, gradients and optimizer state are exact counts of the tensors the workers allocate (checked
by ``tests/distributed/test_memory_plan.py``). The activation and logit terms are estimates of what autograd
keeps for the backward pass, derived from the layers' code (see :func:`activation_bytes`); docs/memory.md
says how they compare with measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nemo_rl.config.model_arch import ModelArch

FLOAT32_BYTES = 4
PRECISION_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each ``policy.precision``."""


def chunk_size(size: int, parts: int) -> int:
    """The largest piece ``torch.chunk`` cuts ``size`` into (rank 0's)."""
    return math.ceil(size / parts) if parts > 1 else size


@dataclass(frozen=True)
class ParamShape:
    """One parameter of the model (or ``count`` parameters of the same shape and layout)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    """The dim tensor parallelism splits; ``None``: replicated over the TP ranks."""
    count: int = 1
    trained: bool = True
    """Whether the parameter has gradients and optimizer state (LoRA freezes the base weights)."""

    def local_numel(self, tp: int, dp: int) -> int:
        """Elements one rank holds of each such parameter: TP split first, then FSDP's dim-0 split over ``dp``."""
        dims = list(self.shape)
        if self.tp_dim is not None:
            dims[self.tp_dim] = chunk_size(dims[self.tp_dim], tp)
        dims[0] = chunk_size(dims[0], dp)
        return math.prod(dims)


def _lora_shapes(name: str, out_in: tuple[int, int], tp_dim: int, count: int, rank: int) -> list[ParamShape]:
    # TP's ParallelStyle splits every parameter of the module on the weight's dim: lora_A [r, in] and
    # lora_B [out, r] on dim 0 (column-parallel) or dim 1 (row-parallel), as nemo_rl.models.lora explains.
    out_features, in_features = out_in
    return [
        ParamShape(f"{name}.lora_A", (rank, in_features), tp_dim, count),
        ParamShape(f"{name}.lora_B", (out_features, rank), tp_dim, count),
    ]


def dtensor_parameters(arch: ModelArch, lora_rank: int | None = None) -> list[ParamShape]:
    """The Hugging Face model's parameters with the DTensor TP plan's split dims (``parallelize.py``).

    With ``lora_rank`` every decoder linear layer gets adapters (``match_all_linear``) and only they train.
    """
    h, i, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    base = lora_rank is None
    linears = [  # (name, [out, in], TP dim): column-parallel split dim 0, row-parallel dim 1
        ("q_proj", (q, h), 0),
        ("k_proj", (kv, h), 0),
        ("v_proj", (kv, h), 0),
        ("o_proj", (h, q), 1),
        ("gate_proj", (i, h), 0),
        ("up_proj", (i, h), 0),
        ("down_proj", (h, i), 1),
    ]
    params = [ParamShape(name, shape, dim, layers, base) for name, shape, dim in linears]
    if arch.qkv_bias:
        params += [
            ParamShape(f"{n}.bias", (size,), 0, layers, base) for n, size in (("q", q), ("k", kv), ("v", kv))
        ]
    if arch.o_bias:  # a row-parallel layer's bias is replicated
        params.append(ParamShape("o_proj.bias", (h,), None, layers, base))
    if arch.mlp_bias:
        params += [ParamShape(f"{n}.bias", (i,), 0, layers, base) for n in ("gate_proj", "up_proj")]
        params.append(ParamShape("down_proj.bias", (h,), None, layers, base))
    params.append(ParamShape("layer norms", (h,), None, layers * 2, base))
    if arch.qk_norm:
        params.append(ParamShape("q/k norms", (arch.head_dim,), None, layers * 2, base))
    params += [
        ParamShape("embed_tokens", (arch.vocab_size, h), 0, 1, base),
        ParamShape("norm", (h,), None, 1, base),
    ]
    if not arch.tie_word_embeddings:
        params.append(ParamShape("lm_head", (arch.vocab_size, h), 0, 1, base))
    if lora_rank is not None:
        for name, shape, dim in linears:
            params += _lora_shapes(name, shape, dim, layers, lora_rank)
    return params


def pipeline_layers(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Decoder layers on each pipeline stage (``num_layers_in_first/last_pipeline_stage`` or an even split)."""
    if pp == 1:
        return [num_layers]
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    each = middle // middle_stages if middle_stages else 0
    stages = [each] * pp
    if first is not None:
        stages[0] = first
    if last is not None:
        stages[-1] = last
    return stages


def megatron_parameters(arch: ModelArch, tp: int, stage: int, stage_layers: list[int]) -> list[ParamShape]:
    """One pipeline stage's parameters of Megatron's ``GPTModel`` (fused QKV and gate/up, vocabulary padded to
    a multiple of TP, ``nemo_rl.models.megatron.setup``). A tied output head has its own copy on the last
    stage when the first stage is another one."""
    h, i, layers = arch.hidden_size, arch.intermediate_size, stage_layers[stage]
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    vocab = math.ceil(arch.vocab_size / tp) * tp
    params = [
        ParamShape("linear_qkv", (qkv, h), 0, layers),
        ParamShape("linear_proj", (h, arch.num_heads * arch.head_dim), 1, layers),
        ParamShape("linear_fc1", (2 * i, h), 0, layers),
        ParamShape("linear_fc2", (h, i), 1, layers),
        ParamShape("layer norms", (h,), None, 2 * layers),
    ]
    if arch.qkv_bias:
        params.append(ParamShape("linear_qkv.bias", (qkv,), 0, layers))
    if arch.o_bias:  # a row-parallel layer's bias is replicated
        params.append(ParamShape("linear_proj.bias", (h,), None, layers))
    if arch.mlp_bias:
        params += [
            ParamShape("linear_fc1.bias", (2 * i,), 0, layers),
            ParamShape("linear_fc2.bias", (h,), None, layers),
        ]
    if arch.qk_norm:
        params.append(ParamShape("q/k norms", (arch.head_dim,), None, 2 * layers))
    first, last = stage == 0, stage == len(stage_layers) - 1
    if first:
        params.append(ParamShape("word_embeddings", (vocab, h), 0))
    if last:
        params.append(ParamShape("final_layernorm", (h,), None))
        if not arch.tie_word_embeddings or not first:
            params.append(ParamShape("output_layer", (vocab, h), 0))
    return params


def parameter_elements(params: list[ParamShape], tp: int, dp: int, trained_only: bool = False) -> int:
    """Elements rank 0 holds of ``params`` (of the trained ones only, with ``trained_only``)."""
    return sum(p.local_numel(tp, dp) * p.count for p in params if p.trained or not trained_only)


OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 1, "adagrad": 1, "rmsprop": 1, "adadelta": 2, "adamax": 2}
"""Tensors of the parameter's size a torch optimizer keeps per parameter (``sgd``: with momentum)."""


def optimizer_states(name: str, kwargs: dict[str, object]) -> int | None:
    """State tensors per trained parameter of the optimizer class ``name`` (an import path); ``None`` when
    the class is not one of :data:`OPTIMIZER_STATES`."""
    short = name.rsplit(".", 1)[-1].lower()
    if short not in OPTIMIZER_STATES:
        return None
    states = OPTIMIZER_STATES[short]
    if short in ("adam", "adamw") and kwargs.get("amsgrad"):
        states += 1
    if short == "sgd" and not kwargs.get("momentum"):
        states = 0
    if short == "rmsprop":
        states += bool(kwargs.get("momentum")) + bool(kwargs.get("centered"))
    return states


def activation_bytes_per_token(
    arch: ModelArch, dtype_bytes: int, tp: int, sequence_parallel: bool
) -> dict[str, float]:
    """Bytes autograd keeps per token for the backward pass, per decoder layer (``layer``), of the layer's
    input alone (``layer_input``, what activation checkpointing keeps) and outside the layers (``outside``).

    Counted from what the Llama / Qwen layers save, ``d`` the compute dtype's bytes, ``q`` and ``kv`` the
    query and key/value widths, ``i`` the MLP width (the last three divided by TP):

    - each RMSNorm: its float32 input (``4 h``) and its normalised output (``d h``); two per layer, split
      over TP along the sequence with sequence parallelism;
    - attention: q, k and v after the rotary embedding (k and v repeated to every query head, as grouped
      attention does before scaled-dot-product attention: ``3 q d``), its output and the output projection's
      input (``2 q d``), its log-sum-exp (``4`` per head); no ``T x T`` scores (flash or memory-efficient
      attention);
    - the gated MLP: gate and up projections, the SiLU of the gate and the product (``4 i d``).
    """
    h = arch.hidden_size
    q = arch.num_heads * arch.head_dim / tp
    i = arch.intermediate_size / tp
    norm = (FLOAT32_BYTES + dtype_bytes) * h / (tp if sequence_parallel else 1) + FLOAT32_BYTES
    attention = 5 * q * dtype_bytes + FLOAT32_BYTES * arch.num_heads / tp
    mlp = 4 * i * dtype_bytes
    return {
        "layer": 2 * norm + attention + mlp,
        "layer_input": dtype_bytes * h / (tp if sequence_parallel else 1),
        "outside": norm + 16,  # the final norm; token ids and positions (int64)
    }


def activation_bytes(
    arch: ModelArch,
    tokens: int,
    num_layers: int,
    dtype_bytes: int,
    tp: int,
    sequence_parallel: bool,
    checkpointing: bool,
) -> int:
    """Activations one micro-batch of ``tokens`` keeps through ``num_layers`` decoder layers, at the end of its
    forward (:func:`activation_bytes_per_token`). With activation checkpointing each layer keeps its input
    and one layer at a time is recomputed in full during the backward pass."""
    per_token = activation_bytes_per_token(arch, dtype_bytes, tp, sequence_parallel)
    if checkpointing:
        layers = num_layers * per_token["layer_input"] + per_token["layer"]
    else:
        layers = num_layers * per_token["layer"]
    return int(tokens * (layers + per_token["outside"]))


def context_parallel_bytes(
    arch: ModelArch, tokens: int, seq_len: int, cp: int, dtype_bytes: int, tp: int
) -> int:
    """What DTensor context parallelism adds to the activations (``nemo_rl/models/policy/context_parallel.py``):
    each layer all-gathers the keys and values of its rows' every token (``2 kv d`` per token of the full rows)
    and keeps them for the attention's backward pass, and one forward builds the additive masks of this rank's
    two chunks, ``C x K`` each (``C = T / 2CP`` queries against the keys up to the chunk's end), shared by the
    layers: ``(2 CP + 1) C^2`` elements in all."""
    kv = tokens * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim / tp * dtype_bytes
    chunk = seq_len // (2 * cp)
    masks = (2 * cp + 1) * chunk * chunk * dtype_bytes
    return int(kv + masks)


def megatron_attention_scores_bytes(
    arch: ModelArch, rows: int, seq_len: int, tp: int, dtype_bytes: int
) -> int:
    """Per layer: the ``T x T`` attention probabilities Megatron's local (non-Transformer-Engine) attention
    keeps, in float32 and in the compute dtype, for each head on this TP rank."""
    return rows * (arch.num_heads // tp) * seq_len * seq_len * (FLOAT32_BYTES + dtype_bytes)


def logits_bytes(tokens: int, vocab: int, dtype_bytes: int, training: bool) -> int:
    """The logits spike at the end of a forward: the output head's ``[tokens, vocab]`` in the compute dtype
    (full vocabulary: the DTensor TP plan all-gathers it), their float32 log-softmax and, when training, its
    gradient in the backward pass."""
    float_copies = 2 if training else 1
    return tokens * vocab * (dtype_bytes + float_copies * FLOAT32_BYTES)


def kv_cache_bytes(arch: ModelArch, rows: int, positions: int, dtype_bytes: int) -> int:
    """The embedded engine's preallocated KV cache ``[layers, 2, rows, kv heads, positions, head dim]``."""
    return arch.num_layers * 2 * rows * arch.num_kv_heads * positions * arch.head_dim * dtype_bytes


def largest_tensor_elements(arch: ModelArch) -> int:
    """Elements of the model's largest single weight (the embedding, or an MLP projection)."""
    return max(arch.vocab_size * arch.hidden_size, arch.intermediate_size * arch.hidden_size)


def layer_elements(arch: ModelArch) -> int:
    """Parameters of one decoder layer."""
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    biases = (q + 2 * kv) * arch.qkv_bias + h * arch.o_bias + (2 * i + h) * arch.mlp_bias
    return h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + biases + 2 * arch.head_dim * arch.qk_norm


def refit_buffer_bytes(arch: ModelArch, bucket_bytes: int, dtype_bytes: int) -> int:
    """The refit's sender buffers: one packed bucket (a weight larger than a bucket travels alone in one of
    its own size) and the full weights of the unit being gathered (the output head's unit or a layer), both
    in the generation dtype."""
    largest = largest_tensor_elements(arch) * dtype_bytes
    unit = max(
        arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2), layer_elements(arch)
    )
    return max(bucket_bytes, largest) + unit * dtype_bytes
