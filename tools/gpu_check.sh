#!/usr/bin/env bash
# The GPU check: everything in this repository that needs a CUDA GPU, in one run of about 10 minutes.
#
#   bash tools/gpu_check.sh [--no-sync] [--out DIR] [--cpu] [--only STAGES] [--pytest-mark EXPR] [--pytest-args ARGS]
#
# Stages, each reported PASS, FAIL or SKIP with its reason:
#   1 env        nvidia-smi, torch and CUDA versions, GPU count, the packages nemo_rl imports
#   2 pytest     every test marked cuda or vllm (pytest -m "cuda or vllm")
#   3 nccl       2 GPUs or more: a 2-process NCCL all-reduce and a collective refit between two GPUs;
#                every GPU machine: a collective refit with both processes on one GPU, which must fall
#                back from NCCL (it refuses two ranks on one GPU) to gloo
#   4 grpo       2 GRPO steps of examples/configs/grpo_math_tiny.yaml on one GPU, asserting on
#                metrics.jsonl: the embedded engine inside the policy workers, the embedded engine in its
#                own worker (a refit before each step), the whole run in the driver's process
#                (cluster.single_process=true), and vLLM in its own worker when vLLM imports
#   5 ppo        2 PPO steps of examples/configs/ppo_math_tiny.yaml on one GPU (the critic alone in the
#                first, both models in the second, the critic offloaded while the policy trains)
#   6 cp         2 GPUs: 3 training steps with context_parallel_size=2 against CP=1 on the same GPUs
#                (tools/gpu_check_cp.py): the DTensor worker, and the Megatron worker at TP=1 when
#                Transformer Engine imports (megatron-core's CP attention is Transformer Engine's)
#   7 heal       a GRPO run on one GPU whose generation worker is SIGKILLed after step 1 replaces it on the
#                GPU, refits it and finishes (tools/gpu_check_heal.py): the embedded engine in its own
#                worker, and vLLM when it imports
#
# By default the script installs the locked environment first (uv sync --locked --extra vllm) and runs
# in it. With --no-sync it runs the python3 on PATH as it is, for a GPU machine without network access:
# torch, transformers and the project's other dependencies must then be importable (PYTHONPATH may add
# them). Per-stage logs go to DIR (--out; default a new temporary directory). The exit status is 1 when a
# stage failed, 0 otherwise. --cpu runs stages 3, 4 and 6's DTensor part without a GPU (gloo, CPU worker
# slots), to try the script itself on any machine. --only runs the stages whose names start with one of the
# comma-separated STAGES (for example --only 1-env,2-pytest,4-grpo-vllm, or --only 6-cp for context
# parallelism alone, when the rest passed on an earlier run and device time is short); --pytest-mark
# replaces stage 2's marker expression (default "cuda or vllm") and --pytest-args its paths and options
# (default "tests"; for example "-n 0 tests/distributed/test_vllm.py").
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SYNC=1
ON_CPU=0
OUT=""
ONLY=""
PYTEST_MARK="cuda or vllm"
PYTEST_ARGS="tests"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --no-sync) SYNC=0 ;;
        --cpu) ON_CPU=1 ;;
        --out) OUT="$2"; shift ;;
        --out=*) OUT="${1#--out=}" ;;
        --only) ONLY="$2"; shift ;;
        --only=*) ONLY="${1#--only=}" ;;
        --pytest-mark) PYTEST_MARK="$2"; shift ;;
        --pytest-mark=*) PYTEST_MARK="${1#--pytest-mark=}" ;;
        --pytest-args) PYTEST_ARGS="$2"; shift ;;
        --pytest-args=*) PYTEST_ARGS="${1#--pytest-args=}" ;;
        -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ -n "$OUT" ]] || OUT="$(mktemp -d -t nemo_rl_gpu_check.XXXXXX)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT" || exit 2

START_S=$SECONDS
# Stages stop in time for the whole run (the install included) to end within 10 minutes; a slower machine
# can give more with GPU_CHECK_BUDGET_S.
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}
export PYTHONUNBUFFERED=1
export NEMO_RL_RAY_TEMP_DIR="${NEMO_RL_RAY_TEMP_DIR:-/tmp/ray_gpu_check}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

RESULTS=()
FAILED=0

record() {  # record NAME STATUS REASON
    RESULTS+=("$(printf '%-22s %-4s  %s' "$1" "$2" "$3")")
    printf '[%4ss] %-22s %-4s  %s\n' "$((SECONDS - START_S))" "$1" "$2" "$3"
    [[ "$2" == FAIL ]] && FAILED=1
    return 0
}

selected() {  # selected NAME: whether --only (if given) names a prefix of NAME
    [[ -z "$ONLY" ]] && return 0
    local prefix
    IFS=',' read -ra prefixes <<<"$ONLY"
    for prefix in "${prefixes[@]}"; do
        [[ "$1" == "$prefix"* ]] && return 0
    done
    return 1
}

time_left() {  # the seconds a stage may take: its own limit or what is left of the budget
    local left=$((BUDGET_S - (SECONDS - START_S)))
    (( left < $1 )) && echo "$left" || echo "$1"
}

# run_stage NAME LIMIT_S CMD...: runs CMD with its output in $OUT/NAME.log. Exit 0 is PASS, 77 SKIP, other
# FAIL; the reason is the command's last output line (a stage helper prints a one-line summary last).
run_stage() {
    local name="$1" limit="$2"; shift 2
    local log="$OUT/$name.log" left rc reason
    if ! selected "$name"; then
        record "$name" SKIP "not selected (--only $ONLY)"
        return
    fi
    (( ON_CPU )) && limit=$((limit * 4))  # CPU worker slots are many times slower than a GPU
    left=$(time_left "$limit")
    if (( left < 20 )); then
        record "$name" FAIL "not run: the 10-minute budget is spent"
        return
    fi
    if declare -F "$1" >/dev/null; then  # a function of this script: run it in a child bash
        export -f "$1"
        timeout --kill-after=15 "$left" bash -c '"$@"' _ "$@" >"$log" 2>&1
    else
        timeout --kill-after=15 "$left" "$@" >"$log" 2>&1
    fi
    rc=$?
    reason="$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-160)"
    case $rc in
        0) record "$name" PASS "$reason" ;;
        77) record "$name" SKIP "${reason#SKIP: }" ;;
        124|137) record "$name" FAIL "timed out after ${left}s (log: $log)" ;;
        *) record "$name" FAIL "exit $rc: $reason (log: $log)" ;;
    esac
}

echo "nemo_rl GPU check; logs in $OUT"

# --- the environment ----------------------------------------------------------------------------------
if (( SYNC )); then
    if ! command -v uv >/dev/null; then
        record sync FAIL "uv is not installed (pip install uv), or run with --no-sync in a prepared environment"
        PY=python3
    elif uv sync --locked --extra vllm >"$OUT/sync.log" 2>&1; then
        record sync PASS "uv sync --locked --extra vllm"
        PY="$ROOT/.venv/bin/python"
    else
        record sync FAIL "uv sync --locked --extra vllm failed (log: $OUT/sync.log)"
        PY=python3
    fi
else
    PY=python3
fi

export PY OUT PYTEST_MARK PYTEST_ARGS

env_report() {
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi || true
        nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv || true
    else
        echo "nvidia-smi: not found"
    fi
    "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
for i in range(count):
    props = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {props.name} {props.total_memory / 2**30:.1f} GiB uuid {props.uuid}")
if count:
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
missing = []
for name in ["transformers", "ray", "pydantic", "omegaconf", "hydra", "math_verify", "safetensors", "pytest", "vllm"]:
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as err:
        print(f"{name}: not importable ({type(err).__name__}: {err})")
        if name != "vllm":
            missing.append(name)
import nemo_rl.algorithms.grpo  # noqa: F401  (the whole training stack imports)
if missing:
    print(f"missing packages: {', '.join(missing)}")
    sys.exit(1)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {count} GPU(s)")
EOF
}
run_stage 1-env 120 env_report

NUM_GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
HAS_VLLM="$("$PY" -c 'import vllm' >/dev/null 2>&1 && echo 1 || echo 0)"
NO_GPU_REASON="no CUDA GPU (torch.cuda.is_available() is False)"

# --- the tests marked cuda or vllm ---------------------------------------------------------------------
pytest_stage() {
    "$PY" -m pytest -m "$PYTEST_MARK" -p no:cacheprovider -q -rs --timeout 300 \
        --junitxml="$OUT/pytest.xml" $PYTEST_ARGS
    local rc=$?
    "$PY" - "$OUT/pytest.xml" "$rc" <<'EOF'
import sys
import xml.etree.ElementTree as ET
path, rc = sys.argv[1], int(sys.argv[2])
try:
    suite = ET.parse(path).getroot()
except (OSError, ET.ParseError):
    print(f"pytest exited {rc} without a report")
    sys.exit(1)
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
passed = total - skipped - failed
reasons = sorted({(case.find("skipped").get("message") or "")[:70] for case in suite.iter("testcase") if case.find("skipped") is not None})
summary = f"{passed} passed, {failed} failed, {skipped} skipped"
if failed or rc not in (0, 5):
    print(f"{summary} (pytest exit {rc})")
    sys.exit(1)
if passed == 0:
    print(f"SKIP: all {skipped} skipped: {'; '.join(reasons)}" if skipped else "SKIP: no test selected")
    sys.exit(77)
print(summary + (f"; skipped: {'; '.join(reasons)}" if reasons else ""))
EOF
}
run_stage 2-pytest-cuda-vllm 300 pytest_stage

# --- NCCL ----------------------------------------------------------------------------------------------
if (( NUM_GPUS >= 2 )); then
    run_stage 3-nccl-allreduce 120 "$PY" tools/gpu_check_nccl.py allreduce
    run_stage 3-nccl-refit-2gpu 120 "$PY" tools/gpu_check_nccl.py refit
else
    record 3-nccl-allreduce SKIP "needs 2 GPUs, this machine has $NUM_GPUS"
fi
if (( NUM_GPUS >= 1 )); then
    run_stage 3-refit-same-gpu 120 "$PY" tools/gpu_check_nccl.py refit --same-gpu
elif (( ON_CPU )); then
    run_stage 3-refit-cpu 180 "$PY" tools/gpu_check_nccl.py refit --cpu
else
    record 3-refit-same-gpu SKIP "$NO_GPU_REASON"
fi

# --- 2 GRPO steps on one GPU ---------------------------------------------------------------------------
# grpo_stage NAME OVERRIDES...: runs the tiny recipe for 2 steps and checks its metrics.jsonl.
grpo_stage() {
    local name="$1"; shift
    local dir="$OUT/$name"
    rm -rf "$dir"
    "$PY" examples/run_grpo_math.py --config examples/configs/grpo_math_tiny.yaml \
        grpo.max_num_steps=2 grpo.val_at_start=false grpo.val_period=0 cluster.gpus_per_node=1 checkpointing.enabled=false "checkpointing.checkpoint_dir=$dir/ckpt" \
        "logger.log_dir=$dir/logs" logger.progress_bar=false "logger.plot_metrics=[]" "$@" || return 1
    "$PY" - "$dir/logs/metrics.jsonl" <<'EOF'
import json, sys
steps = {}
for line in open(sys.argv[1]):
    if line.strip():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
kl = {step: m["train/gen_kl_error"] for step, m in steps.items() if "train/gen_kl_error" in m}
if sorted(kl) != [1, 2]:
    print(f"expected train/gen_kl_error at steps 1 and 2, got it at {sorted(kl)}")
    sys.exit(1)
worst = max(abs(v) for v in kl.values())
if worst > 1e-3:
    print(f"train/gen_kl_error {worst:.2e} > 1e-3 (the engine and the policy disagree): {kl}")
    sys.exit(1)
reward = [round(steps[s].get("train/reward", float("nan")), 3) for s in (1, 2)]
print(f"2 steps, train/gen_kl_error max {worst:.1e}, reward {reward}")
EOF
}
if (( NUM_GPUS >= 1 || ON_CPU )); then
    run_stage 4-grpo-embedded-in-policy 150 grpo_stage 4-grpo-embedded-in-policy \
        policy.generation.backend=embedded policy.generation.embedded_cfg.in_policy_workers=true
    run_stage 4-grpo-embedded-refit 150 grpo_stage 4-grpo-embedded-refit \
        policy.generation.backend=embedded policy.generation.embedded_cfg.in_policy_workers=false
    # The whole run in the driver's process (no Ray); `auto` picks it only without CUDA, so insist here.
    run_stage 4-grpo-one-process 150 grpo_stage 4-grpo-one-process \
        policy.generation.backend=embedded policy.generation.embedded_cfg.in_policy_workers=true \
        cluster.single_process=true
    if (( HAS_VLLM )); then
        run_stage 4-grpo-vllm 240 grpo_stage 4-grpo-vllm \
            policy.generation.backend=vllm policy.generation.embedded_cfg.in_policy_workers=false \
            policy.generation.vllm_cfg.precision=float32
    else
        record 4-grpo-vllm SKIP "vLLM is not importable in $PY"
    fi
else
    record 4-grpo-embedded-in-policy SKIP "$NO_GPU_REASON"
    record 4-grpo-embedded-refit SKIP "$NO_GPU_REASON"
    record 4-grpo-one-process SKIP "$NO_GPU_REASON"
    record 4-grpo-vllm SKIP "$NO_GPU_REASON"
fi

# --- 2 PPO steps on one GPU ----------------------------------------------------------------------------
ppo_stage() {
    local dir="$OUT/5-ppo"
    rm -rf "$dir"
    "$PY" examples/run_ppo.py --config examples/configs/ppo_math_tiny.yaml \
        ppo.max_num_steps=2 ppo.policy_training_start_step=1 ppo.val_at_start=false ppo.val_period=0 \
        ppo.num_prompts_per_step=16 ppo.num_generations_per_prompt=8 policy.train_global_batch_size=128 \
        value.train_global_batch_size=64 cluster.gpus_per_node=1 checkpointing.enabled=false \
        "checkpointing.checkpoint_dir=$dir/ckpt" "logger.log_dir=$dir/logs" logger.progress_bar=false \
        "logger.plot_metrics=[]" || return 1
    "$PY" - "$dir/logs/metrics.jsonl" <<'EOF'
import json, sys
steps = {}
for line in open(sys.argv[1]):
    if line.strip():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
if [steps.get(s, {}).get("train/policy_trained") for s in (1, 2)] != [0.0, 1.0]:
    print(f"expected the critic alone at step 1 and both models at step 2, got {steps}")
    sys.exit(1)
kl = steps[2]["train/gen_kl_error"]
if abs(kl) > 1e-3:
    print(f"train/gen_kl_error {kl:.2e} > 1e-3 at step 2 (the engine and the policy disagree)")
    sys.exit(1)
loss = [round(steps[s]["train/critic/loss"], 4) for s in (1, 2)]
print(f"2 steps, train/gen_kl_error {kl:.1e}, critic loss {loss}")
EOF
}
if (( NUM_GPUS >= 1 || ON_CPU )); then
    run_stage 5-ppo 180 ppo_stage
else
    record 5-ppo SKIP "$NO_GPU_REASON"
fi

# --- context parallelism on 2 GPUs -------------------------------------------------------------------------
if (( NUM_GPUS >= 2 || ON_CPU )); then
    run_stage 6-cp-dtensor 150 "$PY" tools/gpu_check_cp.py dtensor $( (( NUM_GPUS >= 2 )) || echo --cpu )
else
    record 6-cp-dtensor SKIP "context parallelism over 2 GPUs needs 2, this machine has $NUM_GPUS"
fi
if (( NUM_GPUS >= 2 )); then
    run_stage 6-cp-megatron 150 "$PY" tools/gpu_check_cp.py megatron
else
    record 6-cp-megatron SKIP "needs 2 GPUs (this machine has $NUM_GPUS) and Transformer Engine"
fi

# --- a generation worker lost and replaced on one GPU ------------------------------------------------------
if (( NUM_GPUS >= 1 || ON_CPU )); then
    run_stage 7-heal-embedded 240 "$PY" tools/gpu_check_heal.py embedded $( (( NUM_GPUS >= 1 )) || echo --cpu )
    if (( HAS_VLLM && NUM_GPUS >= 1 )); then
        run_stage 7-heal-vllm 300 "$PY" tools/gpu_check_heal.py vllm
    else
        record 7-heal-vllm SKIP "needs a GPU and vLLM importable in $PY"
    fi
else
    record 7-heal-embedded SKIP "$NO_GPU_REASON"
    record 7-heal-vllm SKIP "$NO_GPU_REASON"
fi

# --- summary -------------------------------------------------------------------------------------------
echo
echo "summary ($((SECONDS - START_S)) s, $NUM_GPUS GPU(s), logs in $OUT):"
printf '  %s\n' "${RESULTS[@]}"
printf '%s\n' "${RESULTS[@]}" >"$OUT/summary.txt"
if (( FAILED )); then
    echo "GPU check: FAIL"
    exit 1
fi
echo "GPU check: no stage failed"
exit 0
