"""The embedded engine on image prompts (the tiny Qwen2.5-VL, fp32 on CPU), against transformers:

- greedy outputs equal transformers' ``generate`` for pictures of three sizes, two different pictures of
  the same size (the same tokens), a text prompt and repeats of a prompt (GRPO's group); the vision tower
  runs once per distinct picture; prompts with two pictures (in either order) too;
- sampled tokens' log-probs equal transformers' forward of prompt + response;
- loading new vision-tower weights (what a refit does), also while the engine decodes (the KV cache
  recomputed), changes the output to transformers' with the same weights;
- the generation input's image fields are checked, and a text model refuses images;
- the pictures rebuilt for vLLM from a batch's patches give the processor exactly those patches again;
- the second family, Qwen2-VL, generates as transformers does; vLLM refuses in-flight updates of a
  vision-language model with one line;
- both backends' refit manifests list the weights transformers' model has (tower and projection included).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoProcessor
from vlm_prompts import (
    build_vlm,
    generated,
    generation_batch,
    hf_greedy,
    hf_token_logprobs,
    image_prompts,
    pictures,
)

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.embedded.engine import EmbeddedEngine, SamplingParams
from nemo_rl.models.generation.embedded.images import PromptImages
from nemo_rl.models.generation.embedded.vision import VisionLanguageLM, load_decoder
from nemo_rl.models.generation.interfaces import check_generation_input
from nemo_rl.models.generation.vllm.images import PatchLayout, collapse_placeholders, row_pictures

MAX_NEW_TOKENS = 8
EOS = 2
PAD = 0


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("tiny_vlm_gen")
    hf = build_vlm(path)
    prompts = image_prompts(AutoProcessor.from_pretrained(path), pictures())
    return {"path": path, "hf": hf, "prompts": prompts}


def _engine(path: Path) -> EmbeddedEngine:
    model = load_decoder(path, dtype=torch.float32)
    return EmbeddedEngine(model, pad_token_id=PAD, max_sequence_length=256, decode_fn=None)


def _params(**overrides: Any) -> SamplingParams:
    values: dict[str, Any] = dict(
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        max_new_tokens=MAX_NEW_TOKENS,
        stop_token_ids=frozenset({EOS}),
        stop_strings=(),
    )
    return SamplingParams(**(values | overrides))


def _generate(engine: EmbeddedEngine, batch: BatchedDataDict[Any], **kwargs: Any) -> BatchedDataDict[Any]:
    out = engine.generate(
        batch["input_ids"],
        batch["input_lengths"],
        kwargs.pop("params", _params()),
        seed=kwargs.pop("seed", 0),
        images=PromptImages.of_batch(batch["pixel_values"], batch["image_grid_thw"]),
        **kwargs,
    )
    return BatchedDataDict({key: value for key, value in vars(out).items() if value is not None})


def test_greedy_equals_transformers_generate_with_the_tower_run_once_per_picture(
    vlm: dict[str, Any],
) -> None:
    prompts = vlm["prompts"]
    # Rows: three sizes, a second 56x56 picture, a text prompt, then the first prompt twice more (a group).
    rows = [*prompts, prompts[0], prompts[0]]
    engine = _engine(vlm["path"])
    assert isinstance(engine.model, VisionLanguageLM)
    encoded: list[int] = []
    encode = engine.model.vision.encode
    engine.model.vision.encode = lambda pixels, grid: encoded.append(pixels.shape[0]) or encode(pixels, grid)  # type: ignore[method-assign]
    out = _generate(engine, generation_batch(rows, PAD), greedy=True)
    expected = [hf_greedy(vlm["hf"], prompt, MAX_NEW_TOKENS) for prompt in prompts]
    assert [generated(out, row) for row in range(len(rows))] == [*expected, expected[0], expected[0]]
    # The tower saw each distinct picture once, in one call; different pictures answer differently.
    assert encoded == [sum(p["pixel_values"].shape[0] for p in prompts if p["pixel_values"] is not None)]
    assert expected[0] != expected[3]


def test_a_prompt_with_two_pictures_generates_as_transformers(vlm: dict[str, Any]) -> None:
    first, second, *_ = pictures()
    prompts = image_prompts(AutoProcessor.from_pretrained(vlm["path"]), [[first, second], [second, first]])
    out = _generate(_engine(vlm["path"]), generation_batch(prompts, PAD), greedy=True)
    expected = [hf_greedy(vlm["hf"], prompt, MAX_NEW_TOKENS) for prompt in prompts]
    assert [generated(out, row) for row in range(out.size)] == expected
    assert expected[0] != expected[1]


def test_sampled_logprobs_equal_transformers_forward(vlm: dict[str, Any]) -> None:
    rows = [*vlm["prompts"][:3], vlm["prompts"][0]]
    out = _generate(_engine(vlm["path"]), generation_batch(rows, PAD), greedy=False, seed=3)
    for row, prompt in enumerate(rows):
        tokens = generated(out, row)
        start = int(out["unpadded_sequence_lengths"][row]) - len(tokens)
        torch.testing.assert_close(
            out["logprobs"][row, start : start + len(tokens)],
            hf_token_logprobs(vlm["hf"], prompt, tokens),
            rtol=1e-5,
            atol=1e-5,
        )


def test_new_vision_tower_weights_give_transformers_output_with_them(vlm: dict[str, Any]) -> None:
    engine = _engine(vlm["path"])
    prompts = vlm["prompts"][:3]
    before = _generate(engine, generation_batch(prompts, PAD), greedy=True)
    perturbed = copy.deepcopy(vlm["hf"])
    generator = torch.Generator().manual_seed(7)
    tower = {}
    with torch.no_grad():
        for name, param in perturbed.named_parameters():
            if name.startswith("model.visual."):
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
                tower[name] = param.detach().clone()
    engine.load_weights(tower.items())  # what a refit's LoadFn does with the tower's weights
    after = _generate(engine, generation_batch(prompts, PAD), greedy=True)
    expected = [hf_greedy(perturbed, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    assert [generated(after, row) for row in range(len(prompts))] == expected
    assert [generated(before, row) for row in range(len(prompts))] != expected


def test_image_fields_are_checked_and_a_text_model_refuses_images(
    vlm: dict[str, Any], tiny_assets: Any
) -> None:
    batch = generation_batch(vlm["prompts"][:2], PAD)
    check_generation_input(batch)
    broken = batch.copy()
    broken["image_grid_thw"] = [batch["image_grid_thw"][0], None]
    with pytest.raises(ValueError, match="row 1 has pixel_values or image_grid_thw but not both"):
        check_generation_input(broken)
    broken["image_grid_thw"] = [batch["image_grid_thw"][1], batch["image_grid_thw"][1]]
    with pytest.raises(ValueError, match="does not describe its"):
        check_generation_input(broken)
    model_dir, _ = tiny_assets
    text_engine = _engine(model_dir)
    with pytest.raises(ValueError, match="carry images, but the engine's qwen2 model is a text model"):
        _generate(text_engine, batch, greedy=True)


def test_pictures_rebuilt_for_vllm_give_the_processor_the_same_patches(vlm: dict[str, Any]) -> None:
    processor = AutoProcessor.from_pretrained(vlm["path"])
    layout = PatchLayout.of_processor(processor.image_processor, processor.image_token_id)
    with_images = [p for p in vlm["prompts"] if p["pixel_values"] is not None]
    # One row holding every picture (a prompt with several images), as vLLM gets them.
    pixel_values = torch.cat([p["pixel_values"] for p in with_images])
    grids = torch.cat([p["image_grid_thw"] for p in with_images])
    rebuilt = row_pictures(pixel_values, grids, layout)
    assert len(rebuilt) == len(with_images)
    again = processor.image_processor(images=rebuilt, return_tensors="pt")
    assert torch.equal(again["image_grid_thw"], grids)
    assert torch.equal(again["pixel_values"], pixel_values)
    # vLLM expands each image's placeholder itself: it gets one per image.
    for prompt in with_images:
        ids = prompt["input_ids"].tolist()
        collapsed = collapse_placeholders(ids, prompt["image_grid_thw"], layout)
        num_tokens = ids.count(layout.image_token_id)
        assert collapsed.count(layout.image_token_id) == 1 and len(collapsed) == len(ids) - num_tokens + 1
    with pytest.raises(ValueError, match="placeholders do not match"):
        collapse_placeholders(with_images[0]["input_ids"].tolist(), with_images[1]["image_grid_thw"], layout)


def test_the_second_family_qwen2_vl_generates_as_transformers(tmp_path: Path) -> None:
    hf = build_vlm(tmp_path, family="qwen2_vl")
    prompts = image_prompts(AutoProcessor.from_pretrained(tmp_path), pictures())
    out = _generate(_engine(tmp_path), generation_batch([*prompts, prompts[0]], PAD), greedy=True)
    expected = [hf_greedy(hf, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    assert [generated(out, row) for row in range(out.size)] == [*expected, expected[0]]


def test_in_flight_tower_update_with_the_cache_recomputed_rescores_the_images(vlm: dict[str, Any]) -> None:
    """New vision-tower weights staged while the engine decodes (asynchronous GRPO's in-flight updates):
    with the KV cache recomputed, every token after the update is the new model's on the whole sequence,
    images encoded again by the new tower."""
    perturbed, tower = copy.deepcopy(vlm["hf"]), {}
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, param in perturbed.named_parameters():
            if name.startswith("model.visual."):
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
                tower[name] = param.detach().clone()
    engine = _engine(vlm["path"])
    engine.recompute_kv_cache = True
    decode, calls = engine.model.decode, [0]

    def decode_and_refit_at_step_2(*args: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:  # the refit's thread would call this while the engine decodes
            engine.load_weights(tower.items())
        return decode(*args)

    engine.model.decode = decode_and_refit_at_step_2  # type: ignore[method-assign]
    rows = vlm["prompts"][:2]
    out = _generate(
        engine, generation_batch(rows, PAD), greedy=True, params=_params(stop_token_ids=frozenset())
    )
    assert engine.in_flight.updates_between_steps == 1
    for row, prompt in enumerate(rows):
        tokens = generated(out, row)
        assert len(tokens) == MAX_NEW_TOKENS
        start = int(out["unpadded_sequence_lengths"][row]) - len(tokens)
        # Decode call 3 (step 2) ran on the old weights and gave token 3's logits; tokens 4.. come after.
        torch.testing.assert_close(
            out["logprobs"][row, start + 4 : start + len(tokens)],
            hf_token_logprobs(perturbed, prompt, tokens)[4:],
            rtol=1e-4,
            atol=1e-4,
        )
        torch.testing.assert_close(
            out["logprobs"][row, start : start + 4], hf_token_logprobs(vlm["hf"], prompt, tokens)[:4]
        )


def test_vllm_refuses_in_flight_weight_updates_of_a_vision_language_model(vlm: dict[str, Any]) -> None:
    from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker

    processor = AutoProcessor.from_pretrained(vlm["path"])
    worker = SimpleNamespace(_patch_layout=PatchLayout.of_processor(processor.image_processor, 9))
    with pytest.raises(ValueError, match="in_flight_weight_updates=false") as err:
        VllmGenerationWorker.enable_in_flight_weight_updates(worker, recompute_kv_cache=False)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_both_backends_expect_the_weights_transformers_model_has(vlm: dict[str, Any]) -> None:
    """The refit manifests: the embedded engine's and vLLM's (from transformers' image-text class on the
    meta device) list the language model, the vision tower and its projection under transformers' names."""
    from nemo_rl.models.generation.vllm.convert import hf_weights_manifest
    from nemo_rl.models.hf_config import load_hf_config

    expected = {name: tuple(p.shape) for name, p in vlm["hf"].named_parameters()}
    assert any(name.startswith("model.visual.merger.") for name in expected)
    embedded = load_decoder(vlm["path"], dtype=torch.float32).weights_manifest()
    assert {name: shape for name, (shape, _) in embedded.items()} == expected
    config = load_hf_config(str(vlm["path"]), trust_remote_code=False, overrides={})
    vllm = hf_weights_manifest(config, torch.float32, trust_remote_code=False)
    assert {name: shape for name, (shape, _) in vllm.items()} == expected
