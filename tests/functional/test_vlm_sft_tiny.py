"""examples/run_vlm_sft.py end to end on the tiny Qwen2.5-VL and tiny_clevr: two FSDP2 workers (the language
model sharded, the vision tower replicated) learn, a kill after the step-2 checkpoint resumes bit for bit,
and the final export loads with transformers' own class and processor and scores a held-out picture's
answer better than the starting model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kill_resume import kill_and_resume
from run_logs import read_records

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_vlm_sft.py"
CONFIG = ROOT / "examples" / "configs" / "vlm_sft_tiny.yaml"
TIMEOUT_S = 600


def _command(tmp: Path, max_steps: int) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--config",
        str(CONFIG),
        f"sft.max_num_steps={max_steps}",
        "sft.val_period=2",
        "sft.val_global_batch_size=32",
        "sft.val_micro_batch_size=16",
        "data.num_train_samples=128",
        "data.num_val_samples=32",
        "policy.dtensor_cfg.data_parallel_mode=fsdp",
        # Four steps of the recipe's warm-up move little; a larger rate shows learning within them.
        "policy.optimizer.kwargs.lr=4e-3",
        "checkpointing.save_period=2",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        f"logger.log_dir={tmp / 'logs'}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
    ]


@pytest.mark.slow
def test_vlm_sft_learns_resumes_after_kill_and_exports_a_transformers_model(tmp_path: Path) -> None:
    log_dir, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    kill_and_resume(
        _command(tmp_path, 4),
        log_dir=log_dir,
        ckpt_dir=ckpt,
        checkpoint_step=2,
        max_delay_s=1.0,
        timeout_s=TIMEOUT_S,
    )
    val_losses = [r["validation/val_loss"] for r in read_records(log_dir) if "validation/val_loss" in r]
    assert val_losses[-1] < val_losses[0] - 0.5, f"validation loss did not fall: {val_losses}"

    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from nemo_rl.data.tiny_clevr import scene_record

    export = ckpt / "hf_final"
    processor = AutoProcessor.from_pretrained(export)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    # The exported model reads a held-out picture as the run did: the answer is likelier than at the start.
    record = scene_record(seed=42, index=0, image_size=84, max_objects=5)
    text = processor.apply_chat_template(record["messages"], tokenize=False)
    inputs = processor(
        text=[text], images=[record["messages"][0]["content"][0]["image"]], return_tensors="pt"
    )
    answer_len = (
        len(processor.tokenizer.encode(record["messages"][1]["content"], add_special_tokens=False)) + 1
    )

    def answer_nll(model_dir: Path) -> float:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir)
        with torch.no_grad():
            logits = model(**inputs).logits[0, -answer_len - 1 : -1]
        return float(torch.nn.functional.cross_entropy(logits, inputs["input_ids"][0, -answer_len:]))

    assert answer_nll(export) < answer_nll(ROOT / "examples" / "assets" / "tiny_qwen25vl_init") - 0.5
