"""Convert a training checkpoint's DCP weights to a Hugging Face folder (NeMo RL's command line).

    uv run python examples/converters/convert_dcp_to_hf.py \
        --config results/grpo/step_170/config.yaml \
        --dcp-ckpt-path results/grpo/step_170/policy/weights \
        --hf-ckpt-path results/grpo/hf

``--config`` is the run config saved in the checkpoint (it names the base model, whose architecture the
weights fill, and the tokenizer saved alongside); it defaults to the ``config.yaml`` of the step folder.
``--dcp-ckpt-path`` may also be the step folder itself. ``--dtype`` chooses the saved precision (default: the
run's ``policy.precision``). ``run_eval.py`` reads checkpoints directly; convert to share or serve a model.

A LoRA run's checkpoint (adapters only) converts to the base model with the adapters merged in, or with
``--adapter-only`` to a PEFT adapter folder (``peft.PeftModel.from_pretrained(base_model, hf_ckpt_path)``).
"""

from __future__ import annotations

import argparse

from nemo_rl.config.cli import run_cli
from nemo_rl.config.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line and exit status 2 through run_cli, like every example script.
        raise UserError(f"{message} (see --help)")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and write the Hugging Face folder."""
    parser = _Parser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--config", default=None, help="the run's config.yaml (default: the step folder's)")
    parser.add_argument("--dcp-ckpt-path", required=True, help="step_<N>/policy/weights, or step_<N> itself")
    parser.add_argument("--hf-ckpt-path", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA checkpoint's adapters as a PEFT folder (not merged)",
    )
    args = parser.parse_args(argv)

    from nemo_rl.models.policy.dcp_io import convert_dcp_to_hf, convert_dcp_to_peft, find_training_checkpoint

    checkpoint = find_training_checkpoint(args.dcp_ckpt_path, run_config=args.config)
    if args.adapter_only:
        out = convert_dcp_to_peft(checkpoint, args.hf_ckpt_path)
        print(f"Saved PEFT adapter to: {out}", flush=True)
        return
    out = convert_dcp_to_hf(checkpoint, args.hf_ckpt_path, dtype=args.dtype)
    print(f"Saved HF checkpoint to: {out}", flush=True)


if __name__ == "__main__":
    run_cli(main)
