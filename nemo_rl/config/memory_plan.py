"""The memory plan ``--dry-run`` prints: what each kind of worker holds on one device at its peak, and whether
it fits.

:func:`plan_config` lists, for the policy (training), the reference policy, a distillation teacher, PPO's critic and the
generation engine, the terms of :mod:`nemo_rl.config.memory` at the configured layout and precision. Workers
that share a device take turns (the policy offloads its weights and optimizer to the host while colocated
generation runs, a vLLM engine sleeps while the policy trains), so a device's peak is its largest phase,
not the sum of its workers. :func:`check_plan` turns a plan over ``cluster.device_memory_gb`` into a one-line
:class:`~nemo_rl.config.errors.ConfigError` that names the largest term and what would cut it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from nemo_rl.config import memory as m
from nemo_rl.config.errors import ConfigError
from nemo_rl.config.eval import EvalGenerationConfig
from nemo_rl.config.model_arch import ModelArch, resolve_arch
from nemo_rl.config.policy import GenerationConfig, PolicyConfig

GIB = 2**30

_CUT_STATE = (
    "more data-parallel ranks or TP (policy.dtensor_cfg.tensor_parallel_size / megatron_cfg.tensor_model_"
    "parallel_size), a CPU optimizer (policy.dtensor_cfg.cpu_offload=true) or LoRA "
    "(policy.dtensor_cfg.lora_cfg.enabled=true)"
)
_CUT_ACTIVATIONS = (
    "activation checkpointing (policy.dtensor_cfg.activation_checkpointing=true / megatron_cfg."
    "activation_checkpointing=true), a smaller micro-batch (policy.train_micro_batch_size or "
    "dynamic_batching.train_mb_tokens), more TP with sequence_parallel or context parallelism "
    "(policy.dtensor_cfg.context_parallel_size)"
)
_CUT_LOGITS = (
    "a smaller micro-batch (policy.train_micro_batch_size / logprob_batch_size or the mb_tokens budgets)"
)


@dataclass(frozen=True)
class Term:
    """One term of a worker's peak: its bytes on one device and what would cut it."""

    name: str
    nbytes: int
    cut: str


@dataclass
class WorkerPlan:
    """One kind of worker at its peak on one device."""

    kind: str
    terms: list[Term]
    note: str = ""

    @property
    def nbytes(self) -> int:
        """The sum of the terms."""
        return sum(t.nbytes for t in self.terms)


@dataclass
class MemoryPlan:
    """The plan of one run: the workers' peaks and the device phases they make up."""

    arch_source: str
    device_bytes: int | None
    """Memory of one device (``None``: unknown, the plan is not checked)."""
    device_source: str
    """Where ``device_bytes`` came from, or why it is unknown."""
    workers: list[WorkerPlan] = field(default_factory=list)
    phases: dict[str, list[Term]] = field(default_factory=dict)
    """Each phase's terms on one device; a device's peak is its largest phase."""

    def peak(self) -> tuple[str, int]:
        """The largest phase and its bytes."""
        totals = {name: sum(t.nbytes for t in terms) for name, terms in self.phases.items()}
        name = max(totals, key=lambda k: totals[k])
        return name, totals[name]


# ------------------------------------------------------------------------------------------------ policy
def train_tokens(policy: PolicyConfig) -> int:
    """Tokens of the largest training micro-batch (a token budget with dynamic batching or packing)."""
    if policy.dynamic_batching.enabled:
        return policy.dynamic_batching.train_mb_tokens
    if policy.packs_sequences and policy.sequence_packing.train_mb_tokens is not None:
        return policy.sequence_packing.train_mb_tokens
    return policy.train_micro_batch_size * policy.max_total_sequence_length


def logprob_tokens(policy: PolicyConfig) -> int:
    """Tokens of the largest log-prob micro-batch."""
    if policy.dynamic_batching.enabled:
        return policy.dynamic_batching.logprob_mb_tokens
    if policy.packs_sequences and policy.sequence_packing.logprob_mb_tokens is not None:
        return policy.sequence_packing.logprob_mb_tokens
    rows = policy.logprob_batch_size or policy.train_micro_batch_size
    return rows * policy.max_total_sequence_length


def _dtensor_state(arch: ModelArch, policy: PolicyConfig, slots: int) -> tuple[list[Term], str]:
    """Weights, gradients, optimizer state, LoRA and FSDP's gathered copies of one DTensor rank."""
    cfg = policy.dtensor_cfg
    tp = cfg.tensor_parallel_size
    lora = cfg.lora_cfg.dim if cfg.lora_cfg.enabled else None
    fsdp = cfg.data_parallel_mode == "fsdp" and (
        slots > 1 or policy.precision != "float32" or cfg.cpu_offload
    )
    dp = slots // tp if fsdp else 1
    params = m.dtensor_parameters(arch, lora)
    assert policy.optimizer is not None  # the schema requires it with the DTensor backend
    states = m.optimizer_states(policy.optimizer.name, policy.optimizer.kwargs)
    note = "" if states is not None else f"{policy.optimizer.name}: unknown optimizer, 2 states assumed; "
    states = 2 if states is None else states
    base = [p for p in params if ".lora_" not in p.name]
    adapters = [p for p in params if ".lora_" in p.name]
    weight_elems = m.parameter_elements(base, tp, dp)
    trained = m.parameter_elements(base, tp, dp, trained_only=True)
    adapter_elems = m.parameter_elements(adapters, tp, dp)
    on_device = 0 if cfg.cpu_offload else m.FLOAT32_BYTES
    terms = [
        Term("weights (float32 master)", weight_elems * on_device, _CUT_STATE),
        Term("gradients (float32)", trained * on_device, _CUT_STATE),
        Term(f"optimizer state ({states} x float32)", states * trained * on_device, _CUT_STATE),
    ]
    if lora is not None:
        lora_bytes = adapter_elems * (2 + states) * m.FLOAT32_BYTES
        terms.append(Term("LoRA adapters + gradients + optimizer", lora_bytes, "a smaller lora_cfg.dim"))
    if fsdp and (dp > 1 or policy.precision != "float32"):
        # FSDP2 all-gathers the root unit (embedding, head, final norm) for the whole pass and each layer
        # (the current one and the prefetched next) in the compute dtype.
        root = (1 + (not arch.tie_word_embeddings)) * m.chunk_size(arch.vocab_size, tp) * arch.hidden_size
        gathered = (root + 2 * m.layer_elements(arch) // tp) * m.PRECISION_BYTES[policy.precision]
        terms.append(
            Term("FSDP all-gathered copies", gathered, "more TP (policy.dtensor_cfg.tensor_parallel_size)")
        )
    if cfg.cpu_offload:
        note += "weights, gradients and optimizer state live on the host (cpu_offload); "
    return terms, note


def _dtensor_policy(arch: ModelArch, policy: PolicyConfig, slots: int) -> list[Term]:
    cfg = policy.dtensor_cfg
    d = m.PRECISION_BYTES[policy.precision]
    terms, _ = _dtensor_state(arch, policy, slots)
    tokens = train_tokens(policy)
    cp = cfg.context_parallel_size
    # Context parallelism: each rank runs 1/CP of every row's tokens through the layers, gathers the keys and
    # values of the full rows in attention, and gathers the head's output back to full rows for the loss.
    activations = m.activation_bytes(
        arch,
        -(-tokens // cp),
        arch.num_layers,
        d,
        cfg.tensor_parallel_size,
        cfg.sequence_parallel,
        cfg.activation_checkpointing,
    )
    split = f" / CP {cp}" if cp > 1 else ""
    label = f"activations ({tokens} tokens{split}{', checkpointed' if cfg.activation_checkpointing else ''})"
    terms.append(Term(label, activations, _CUT_ACTIVATIONS))
    if cp > 1:
        seq_len = policy.max_total_sequence_length
        added = m.context_parallel_bytes(arch, tokens, seq_len, cp, d, cfg.tensor_parallel_size)
        terms.append(Term("CP keys/values and masks", added, _CUT_ACTIVATIONS))
    terms.append(Term("logits spike", m.logits_bytes(tokens, arch.vocab_size, d, training=True), _CUT_LOGITS))
    return terms


def megatron_stage_terms(arch: ModelArch, policy: PolicyConfig, slots: int, stage: int) -> list[Term]:
    """One Megatron rank of pipeline ``stage``: weights in ``policy.precision``, gradients in the DDP buffer,
    optimizer state (float32 master copy when training in 16 bits, divided over the data-parallel ranks by
    the distributed optimizer), and the activations of the micro-batches in flight (1F1B keeps up to
    ``PP - stage`` of them)."""
    cfg = policy.megatron_cfg
    tp, pp, cp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size
    dp = max(slots // (tp * pp * cp), 1)
    layers = m.pipeline_layers(
        arch.num_layers, pp, cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage
    )
    elements = m.parameter_elements(m.megatron_parameters(arch, tp, stage, layers), tp, 1)
    d = m.PRECISION_BYTES[policy.precision]
    grad = m.FLOAT32_BYTES if cfg.distributed_data_parallel_config.grad_reduce_in_fp32 else d
    optim = cfg.optimizer
    states = 2 if optim.optimizer == "adam" else int(optim.sgd_momentum > 0)
    states += policy.precision != "float32"  # the float32 master copy
    optim_elements = m.chunk_size(elements, dp) if optim.use_distributed_optimizer else elements
    tokens = train_tokens(policy)
    in_flight = pp - stage
    if not policy.dynamic_batching.enabled:
        rows_per_rank = policy.train_global_batch_size // dp
        in_flight = min(in_flight, max(rows_per_rank // policy.train_micro_batch_size, 1))
    activations = in_flight * m.activation_bytes(  # a CP rank's layers hold 1/CP of each row
        arch, -(-tokens // cp), layers[stage], d, tp, cfg.sequence_parallel, cfg.activation_checkpointing
    )
    if cfg.transformer_impl == "local" and not cfg.activation_checkpointing:
        rows = tokens / policy.max_total_sequence_length
        scores = m.megatron_attention_scores_bytes(arch, 1, policy.max_total_sequence_length, tp, d)
        activations += int(in_flight * layers[stage] * rows * scores)
    terms = [
        Term(f"weights ({policy.precision})", elements * d, _CUT_STATE),
        Term("gradients (DDP buffer)", elements * grad, _CUT_STATE),
        Term(
            f"optimizer state ({states} x float32)",
            optim_elements * states * m.FLOAT32_BYTES,
            "megatron_cfg.optimizer.use_distributed_optimizer=true, " + _CUT_STATE,
        ),
        Term(f"activations ({in_flight} x {tokens} tokens)", activations, _CUT_ACTIVATIONS),
    ]
    if stage == pp - 1:
        terms.append(
            Term("logits spike", m.logits_bytes(tokens, arch.vocab_size, d, training=True), _CUT_LOGITS)
        )
    return terms


def policy_train_terms(arch: ModelArch, policy: PolicyConfig, slots: int) -> list[Term]:
    """The training peak of one policy rank (the most loaded pipeline stage with Megatron)."""
    if policy.dtensor_cfg.enabled:
        return _dtensor_policy(arch, policy, slots)
    stages = [
        megatron_stage_terms(arch, policy, slots, s)
        for s in range(policy.megatron_cfg.pipeline_model_parallel_size)
    ]
    return max(stages, key=lambda terms: sum(t.nbytes for t in terms))


def scoring_terms(arch: ModelArch, policy: PolicyConfig, slots: int, what: str) -> list[Term]:
    """A log-prob pass (reference, previous policy, teacher): weights on the device, optimizer state on the
    host, one layer's activations at a time and the logits of the largest log-prob micro-batch."""
    d = m.PRECISION_BYTES[policy.precision]
    tokens = logprob_tokens(policy)
    if policy.dtensor_cfg.enabled:
        weights = [
            t for t in _dtensor_state(arch, policy, slots)[0] if t.name.startswith(("weights", "FSDP"))
        ]
        tp = policy.dtensor_cfg.tensor_parallel_size
        # One layer at a time on this rank's 1/CP of the tokens; the logits are gathered back to full rows.
        layer_tokens = -(-tokens // policy.dtensor_cfg.context_parallel_size)
    else:
        weights = megatron_stage_terms(arch, policy, slots, 0)[:1]
        tp = policy.megatron_cfg.tensor_model_parallel_size
        layer_tokens = tokens
    layer = m.activation_bytes(arch, layer_tokens, 1, d, tp, False, False)
    return [
        *weights,
        Term(f"{what} activations (one layer, {layer_tokens} tokens)", layer, _CUT_LOGITS),
        Term(f"{what} logits", m.logits_bytes(tokens, arch.vocab_size, d, training=False), _CUT_LOGITS),
    ]


# -------------------------------------------------------------------------------------------- generation
def generation_terms(
    arch: ModelArch, gen: GenerationConfig, max_len: int, rows: int, device_bytes: int | None
) -> list[Term]:
    """The generation engine on one device: vLLM's ``gpu_memory_utilization`` share (weights, activations and
    KV cache inside it), or the embedded engine's weights and its KV cache for ``rows`` sequences."""
    if gen.backend == "vllm":
        share = gen.vllm_cfg.gpu_memory_utilization
        nbytes = int(share * device_bytes) if device_bytes is not None else 0
        cut = "a lower policy.generation.vllm_cfg.gpu_memory_utilization"
        return [Term(f"vLLM gpu_memory_utilization={share} of the device", nbytes, cut)]
    d = m.PRECISION_BYTES[gen.embedded_cfg.precision]
    kv = m.kv_cache_bytes(arch, rows, max_len, d)
    return [
        Term(
            f"embedded engine weights ({gen.embedded_cfg.precision})",
            arch.num_parameters * d,
            "policy.generation.embedded_cfg.precision=bfloat16",
        ),
        Term(
            f"embedded KV cache ({rows} rows x {max_len} positions)",
            kv,
            "a smaller policy.generation_batch_size",
        ),
    ]


def refit_terms(arch: ModelArch, policy: PolicyConfig) -> list[Term]:
    """The refit's sender buffers (:func:`nemo_rl.config.memory.refit_buffer_bytes`)."""
    gen = policy.generation
    precision = gen.vllm_cfg.precision if gen.backend == "vllm" else gen.embedded_cfg.precision
    nbytes = m.refit_buffer_bytes(arch, policy.refit_buffer_size_mb * 2**20, m.PRECISION_BYTES[precision])
    return [Term("refit buffers (bucket + gathered unit)", nbytes, "a smaller policy.refit_buffer_size_mb")]


def device_memory_bytes(cluster_gb: float | None) -> tuple[int | None, str]:
    """The device memory to plan for: ``cluster.device_memory_gb`` (GiB), else the first GPU ``nvidia-smi``
    reports, else ``None``."""
    if cluster_gb is not None:
        return int(cluster_gb * GIB), f"cluster.device_memory_gb={cluster_gb:g}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "no GPU visible and cluster.device_memory_gb unset"
    out = subprocess.run(
        [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    lines = out.stdout.split()
    if out.returncode != 0 or not lines:
        return None, "nvidia-smi reported no GPU and cluster.device_memory_gb is unset"
    return int(float(lines[0]) * 2**20), f"GPU 0 (nvidia-smi: {lines[0]} MiB)"


# ------------------------------------------------------------------------------------------- the run
def _policy_slots(policy: PolicyConfig, world_size: int) -> tuple[int, int]:
    """Worker slots of the policy and of generation (the same slots when colocated)."""
    colocated = policy.generation.colocated
    if colocated.enabled:
        return world_size, world_size
    gen_slots = (colocated.resources.gpus_per_node or 0) * (colocated.resources.num_nodes or 1)
    return max(world_size - gen_slots, 1), gen_slots


def _generation_rows(policy: PolicyConfig, samples: int, gen_slots: int, policy_slots: int) -> int:
    """Sequences one embedded replica decodes at once: ``generation_batch_size`` or its share of the step."""
    if policy.generation_batch_size is not None:
        return policy.generation_batch_size
    embedded = policy.generation.embedded_cfg
    if embedded.in_policy_workers:
        replicas = policy_slots // (
            policy.dtensor_cfg.tensor_parallel_size * policy.dtensor_cfg.context_parallel_size
        )
    else:
        replicas = embedded.data_parallel_size or gen_slots
    return -(-samples // max(replicas, 1))


def _weights_only(terms: list[Term]) -> list[Term]:
    return [t for t in terms if t.name.startswith(("weights", "FSDP"))]


def plan_config(config: Any) -> MemoryPlan | str:
    """The memory plan of a validated master config, or one line saying why there is none."""
    if getattr(config, "cluster", None) is None:
        return "no memory plan: this config has no cluster section"
    policy = getattr(config, "policy", None)
    if not isinstance(policy, PolicyConfig):
        if isinstance(getattr(config, "generation", None), EvalGenerationConfig):
            return _plan_eval(config)
        return "no memory plan: this config has no policy or generation section"
    arch, source = resolve_arch(policy.model_name, policy.hf_config_overrides)
    if arch is None:
        return f"no memory plan: the architecture of policy.model_name is unknown ({source})"
    device_bytes, device_source = device_memory_bytes(config.cluster.device_memory_gb)
    critic_slots = _critic_own_slots(config)
    slots, gen_slots = _policy_slots(policy, config.cluster.world_size - critic_slots)
    plan = MemoryPlan(source, device_bytes, device_source)
    train = policy_train_terms(arch, policy, slots)
    plan.workers.append(WorkerPlan("policy (training)", train))
    plan.phases["policy training"] = train
    algorithm = next(
        (getattr(config, k) for k in ("grpo", "ppo", "distillation") if hasattr(config, k)), None
    )
    kl = getattr(getattr(config, "loss_fn", None), "reference_policy_kl_penalty", 0.0)
    if hasattr(config, "dpo") or kl:
        scoring = scoring_terms(arch, policy, slots, "reference")
        weights = sum(t.nbytes for t in _weights_only(train) if t.name.startswith("weights"))
        lora = policy.dtensor_cfg.enabled and policy.dtensor_cfg.lora_cfg.enabled
        note = (
            "the base model itself with the adapters switched off: no copy"
            if lora
            else f"a host copy of the policy's weights ({weights / GIB:.2f} GiB of host memory per rank), "
            "swapped into the policy's tensors for its log-prob pass"
        )
        plan.workers.append(WorkerPlan("reference", scoring, note))
        plan.phases["reference log-prob pass"] = scoring
    missing = _add_teacher_and_critic(plan, config, slots, critic_slots)
    if missing:
        return missing
    if algorithm is not None:
        rows = _generation_rows(policy, algorithm.samples_per_step, gen_slots, slots)
        gen = generation_terms(arch, policy.generation, policy.max_total_sequence_length, rows, device_bytes)
        plan.workers.append(WorkerPlan("generation", gen, _generation_note(policy)))
        plan.phases["generation"] = gen
        refit = refit_terms(arch, policy)
        plan.workers.append(WorkerPlan("refit (policy side)", refit))
        gen_weights = _generation_weights(arch, policy.generation)
        if policy.generation.colocated.enabled:
            plan.phases["refit"] = _weights_only(train) + refit + gen_weights
        else:
            plan.phases["refit (policy devices)"] = _weights_only(train) + refit
    return plan


def _critic_own_slots(config: Any) -> int:
    """PPO's critic's slots of its own (0 when it shares the policy's)."""
    colocated = getattr(getattr(config, "ppo", None), "value_colocated", None)
    if colocated is None or colocated.enabled:
        return 0
    return int(colocated.resources.gpus_per_node or 0) * config.cluster.num_nodes


def _add_teacher_and_critic(plan: MemoryPlan, config: Any, slots: int, critic_slots: int) -> str | None:
    """Add distillation's teacher and PPO's critic (on the policy's ``slots``, or on ``critic_slots`` of its
    own) to ``plan``; one line when an architecture is unknown."""
    teacher: PolicyConfig | None = getattr(config, "teacher", None)
    if teacher is not None:
        teacher_arch, teacher_source = resolve_arch(teacher.model_name, teacher.hf_config_overrides)
        if teacher_arch is None:
            return f"no memory plan: the architecture of teacher.model_name is unknown ({teacher_source})"
        scoring = scoring_terms(teacher_arch, teacher, slots, "teacher")
        plan.workers.append(WorkerPlan("teacher", scoring, "offloaded to the host outside its scoring pass"))
        plan.phases["teacher scoring"] = scoring
    value: PolicyConfig | None = getattr(config, "value", None)
    if value is not None:
        value_arch, value_source = resolve_arch(value.model_name, value.hf_config_overrides)
        if value_arch is None:
            return f"no memory plan: the architecture of value.model_name is unknown ({value_source})"
        # The critic's head has one output per token: no vocabulary-wide logits.
        own = critic_slots > 0
        terms = policy_train_terms(value_arch, value, critic_slots if own else slots)
        critic = [t for t in terms if t.name != "logits spike"]
        note = "on slots of its own" if own else "offloaded while the policy trains"
        plan.workers.append(WorkerPlan("value (critic training)", critic, note))
        plan.phases["critic training (critic devices)" if own else "critic training"] = critic
    return None


def _generation_weights(arch: ModelArch, gen: GenerationConfig) -> list[Term]:
    """The engine's weights while a colocated refit writes them (vLLM awake, the KV cache not yet back)."""
    precision = gen.vllm_cfg.precision if gen.backend == "vllm" else gen.embedded_cfg.precision
    tp = gen.vllm_cfg.tensor_parallel_size if gen.backend == "vllm" else 1
    nbytes = arch.num_parameters * m.PRECISION_BYTES[precision] // tp
    return [
        Term(
            f"generation weights ({precision})",
            nbytes,
            "a larger policy.generation.vllm_cfg.tensor_parallel_size",
        )
    ]


def _generation_note(policy: PolicyConfig) -> str:
    if not policy.generation.colocated.enabled:
        return "on its own devices"
    if policy.generation.backend == "vllm":
        return "colocated: asleep (weights on the host, KV cache freed) while the policy trains"
    return "colocated: weights offloaded and KV cache freed while the policy trains"


def _plan_eval(config: Any) -> MemoryPlan | str:
    """``run_eval.py``: the generation engine alone."""
    gen = config.generation
    arch, source = resolve_arch(gen.model_name)
    if arch is None:
        return f"no memory plan: the architecture of generation.model_name is unknown ({source})"
    device_bytes, device_source = device_memory_bytes(config.cluster.device_memory_gb)
    rows = gen.generation_batch_size or 1
    terms = generation_terms(arch, gen, gen.max_total_sequence_length, rows, device_bytes)
    plan = MemoryPlan(source, device_bytes, device_source, workers=[WorkerPlan("generation", terms)])
    plan.phases["generation"] = terms
    return plan


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:8.2f} GiB"


def format_plan(plan: MemoryPlan) -> str:
    """The plan as ``--dry-run`` prints it: each worker's terms, each phase's total, the peak."""
    lines = [f"memory plan (architecture from {plan.arch_source}; bytes per device, the most loaded rank):"]
    for worker in plan.workers:
        lines.append(f"  {worker.kind}" + (f": {worker.note}" if worker.note else ""))
        lines += [f"    {t.name:<56}{_gib(t.nbytes)}" for t in worker.terms]
        lines.append(f"    {'total':<56}{_gib(worker.nbytes)}")
    lines.append("  phases (workers on one device take turns; its peak is the largest phase):")
    for name, terms in plan.phases.items():
        lines.append(f"    {name:<56}{_gib(sum(t.nbytes for t in terms))}")
    phase, peak = plan.peak()
    device_bytes, device_source = plan.device_bytes, plan.device_source
    if device_bytes is None:
        lines.append(f"  peak: {phase}, {peak / GIB:.2f} GiB; not checked: {device_source}")
    else:
        verdict = "fits" if peak <= device_bytes else "DOES NOT FIT"
        lines.append(
            f"  peak: {phase}, {peak / GIB:.2f} GiB of {device_bytes / GIB:.2f} GiB ({device_source}): {verdict}"
        )
    return "\n".join(lines) + "\n"


def check_plan(plan: MemoryPlan) -> None:
    """Raise a one-line :class:`ConfigError` when the plan's peak phase exceeds the device memory."""
    device_bytes, device_source = plan.device_bytes, plan.device_source
    if device_bytes is None:
        return
    phase, peak = plan.peak()
    if peak <= device_bytes:
        return
    largest = max(plan.phases[phase], key=lambda t: t.nbytes)
    raise ConfigError(
        f"the memory plan needs {peak / GIB:.2f} GiB per device in its {phase} phase, more than the "
        f"{device_bytes / GIB:.2f} GiB of {device_source}; the largest term is {largest.name} "
        f"({largest.nbytes / GIB:.2f} GiB): cut it with {largest.cut}"
    )
