#!/usr/bin/env bash
# The README's first command on a fresh clone, with and without the project's [tool.uv] compile-bytecode:
# clones this checkout's HEAD twice (the second clone with the compile-bytecode line removed from
# pyproject.toml), then runs the main job cut to one step twice in each, printing when the first step's line
# appears, when the run ends, and any bytecode warning. Run from the repository root:
#   bash benchmarks/fresh_clone_first_step.sh [WORK_DIR]
# uv's package cache is used as it is: fill it first (any `uv sync --locked`) to leave downloads out.
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
work=${1:-$(mktemp -d)}
for mode in after before; do
  clone="$work/clone_$mode"
  rm -rf "$clone"
  git clone -q "$repo" "$clone"
  if [[ $mode == before ]]; then
    sed -i '/^compile-bytecode = true/d' "$clone/pyproject.toml"
  fi
  for run in 1 2; do
    start=$(date +%s.%N)
    (cd "$clone" && env -u VIRTUAL_ENV uv run python examples/run_grpo_math.py \
      --config examples/configs/grpo_math_tiny_main.yaml grpo.max_num_steps=1 checkpointing.enabled=false \
      logger.progress_bar=false "logger.log_dir=$work/logs_${mode}_$run" 2>&1) |
      while IFS= read -r line; do
        case $line in
          *"[grpo 1/1]"* | *PYTHONDONTWRITEBYTECODE*)
            printf '%s run %s at %6.1f s: %s\n' "$mode" "$run" "$(echo "$(date +%s.%N) - $start" | bc)" "${line:0:100}"
            ;;
        esac
      done
    printf '%s run %s ended at %6.1f s (load %s)\n' "$mode" "$run" "$(echo "$(date +%s.%N) - $start" | bc)" \
      "$(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
