"""Tiny CLEVR-like scenes: coloured circles, squares and triangles drawn with PIL from a seed, and the question
"how many shapes?" with a verifiable answer (``dataset_name: tiny_clevr``).

Scene ``i`` of seed ``s`` is drawn from ``random.Random(f"{s}:clevr:{i}")``: 1 to ``max_objects`` shapes of
random colour, kind and size, placed without overlap on a grey square of ``image_size`` pixels. The same
``(seed, i)`` always gives the same picture, so nothing is stored: a row is drawn when it is read.
Validation holds scenes ``0 .. num_val - 1`` and training the next ``num_train``, so the held-out images stay
the same whatever ``num_train`` is and are never trained on (as :func:`nemo_rl.data.tiny.tiny_math_splits`).

A row is a record with one user turn (the image, then the question) and the answer
``\\boxed{N}`` as the assistant turn; ``expected_answer`` is ``N`` for a verifier.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from PIL import Image, ImageDraw

from nemo_rl.data.datasets.lazy import LazySequence

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
KINDS = ("circle", "square", "triangle")
BACKGROUND = (128, 128, 128)
QUESTION = "How many shapes are in the picture?"


@dataclasses.dataclass(frozen=True)
class Shape:
    """One shape of a scene: its kind, colour and bounding box."""

    kind: str
    colour: str
    box: tuple[int, int, int, int]
    """``(left, top, right, bottom)`` in pixels."""


def _overlaps(a: tuple[int, int, int, int], b: tuple[int, int, int, int], gap: int) -> bool:
    return not (a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1])


def scene_shapes(rng: random.Random, image_size: int, max_objects: int) -> list[Shape]:
    """1 to ``max_objects`` non-overlapping shapes (fewer only if the square has no room left for one)."""
    wanted = rng.randint(1, max_objects)
    shapes: list[Shape] = []
    low, high = max(6, image_size // 8), max(8, image_size // 5)
    for _ in range(200 * wanted):
        if len(shapes) == wanted:
            break
        size = rng.randint(low, high)
        left, top = rng.randint(1, image_size - size - 1), rng.randint(1, image_size - size - 1)
        box = (left, top, left + size, top + size)
        if any(_overlaps(box, s.box, gap=2) for s in shapes):
            continue
        shapes.append(Shape(rng.choice(KINDS), rng.choice(sorted(COLOURS)), box))
    return shapes


def draw_scene(shapes: list[Shape], image_size: int) -> Image.Image:
    """The RGB picture of ``shapes``."""
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape in shapes:
        fill = COLOURS[shape.colour]
        left, top, right, bottom = shape.box
        if shape.kind == "circle":
            draw.ellipse(shape.box, fill=fill)
        elif shape.kind == "square":
            draw.rectangle(shape.box, fill=fill)
        else:
            draw.polygon([((left + right) // 2, top), (left, bottom), (right, bottom)], fill=fill)
    return image


def scene_record(seed: int, index: int, image_size: int, max_objects: int) -> dict[str, Any]:
    """Scene ``index`` of ``seed`` as a record: the image and question, the boxed count, the count."""
    shapes = scene_shapes(random.Random(f"{seed}:clevr:{index}"), image_size, max_objects)
    count = str(len(shapes))
    user = [{"type": "image", "image": draw_scene(shapes, image_size)}, {"type": "text", "text": QUESTION}]
    return {
        "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": f"\\boxed{{{count}}}"},
        ],
        "expected_answer": count,
    }


@dataclasses.dataclass(eq=False)
class TinyClevrRows(LazySequence[dict[str, Any]]):
    """Scenes ``first .. first + num - 1`` of ``seed``, each drawn when read."""

    seed: int
    first: int
    num: int
    image_size: int
    max_objects: int

    def __len__(self) -> int:
        return self.num

    def _item(self, i: int) -> dict[str, Any]:
        return scene_record(self.seed, self.first + i, self.image_size, self.max_objects)


def tiny_clevr_splits(
    num_train: int, num_val: int, *, seed: int, image_size: int, max_objects: int
) -> tuple[TinyClevrRows, TinyClevrRows]:
    """Training and held-out scenes (validation first; see the module docstring)."""
    val = TinyClevrRows(seed, 0, num_val, image_size, max_objects)
    train = TinyClevrRows(seed, num_val, num_train, image_size, max_objects)
    return train, val
