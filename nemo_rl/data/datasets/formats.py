"""Row schemas of the supported datasets and their conversion to canonical :class:`Record` s.

Every converter takes one raw row (a mapping, as read from JSONL / Parquet / the hub) and its index, and
either returns a record or raises :class:`MalformedRowError` saying which row and what is missing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, cast

from nemo_rl.config.data import DataConfig, DatasetName
from nemo_rl.data.errors import DataError
from nemo_rl.data.interfaces import ChatMessage, Record

RowConverter = Callable[[Mapping[str, Any], int], Record]


class MalformedRowError(DataError):
    """A dataset row does not have the fields its dataset's schema needs.

    The message names the row by its 0-based ``index`` in the source and, once known, the ``line`` of the file
    it is on (see :meth:`at_line`).
    """

    def __init__(self, source: str, index: int, problem: str, schema: str, line: int | None = None) -> None:
        where = f"row {index} (0-based)" if line is None else f"line {line} (row {index}, 0-based)"
        super().__init__(f"{source}: {where} {problem}. Rows of this dataset need {schema}.")
        self.source, self.index, self.problem, self.schema, self.line = source, index, problem, schema, line

    def at_line(self, line: int) -> MalformedRowError:
        """The same error, naming the 1-based ``line`` of the file the row is on."""
        return MalformedRowError(self.source, self.index, self.problem, self.schema, line)


class _RowReader:
    """Field access on one row that turns every defect into a :class:`MalformedRowError`."""

    def __init__(self, row: Mapping[str, Any], index: int, source: str, schema: str) -> None:
        self.row, self.index, self.source, self.schema = row, index, source, schema
        if not isinstance(row, Mapping):
            self.fail(f"is a {type(row).__name__}, not an object with named fields")

    def fail(self, problem: str) -> NoReturn:
        raise MalformedRowError(self.source, self.index, problem, self.schema)

    def has(self, key: str) -> bool:
        return self.row.get(key) is not None

    def text(self, key: str) -> str:
        """Field ``key`` as a string; numbers are accepted (answers are often stored as numbers)."""
        if key not in self.row:
            self.fail(f"is missing {key!r} (it has {sorted(self.row)})")
        value = self.row[key]
        if value is None:
            self.fail(f"has {key!r}: null")
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            self.fail(f"has {key!r} of type {type(value).__name__}, expected a string")
        if not str(value).strip():
            self.fail(f"has an empty {key!r}")
        return str(value)


def math_converter(source: str) -> RowConverter:
    """OpenMathInstruct-2's schema (also ``tiny_math``): ``problem`` and ``generated_solution`` and/or
    ``expected_answer``. The solution becomes the assistant reply; the answer, the RL ground truth."""
    schema = "'problem' (string) and 'generated_solution' (SFT) and/or 'expected_answer' (RL)"

    def convert(row: Mapping[str, Any], index: int) -> Record:
        reader = _RowReader(row, index, source, schema)
        messages = [ChatMessage(role="user", content=reader.text("problem"))]
        if not reader.has("generated_solution") and not reader.has("expected_answer"):
            reader.fail(f"has neither 'generated_solution' nor 'expected_answer' (it has {sorted(row)})")
        if reader.has("generated_solution"):
            messages.append(ChatMessage(role="assistant", content=reader.text("generated_solution")))
        record = Record(messages=messages)
        if reader.has("expected_answer"):
            record["expected_answer"] = reader.text("expected_answer")
        return record

    return convert


def _problem_and_answer(problem: str, answer: str) -> Record:
    """A math record as NeMo RL's math datasets build it: the problem as the user turn, the answer as the
    assistant reply (what SFT learns) and as the RL ground truth."""
    return Record(
        messages=[ChatMessage(role="user", content=problem), ChatMessage(role="assistant", content=answer)],
        expected_answer=answer,
    )


def answer_converter(source: str, problem_key: str = "problem", answer_key: str = "answer") -> RowConverter:
    """Problem/answer columns (DeepScaleR, AIME 2024): ``problem_key`` becomes the user turn and ``answer_key``
    (a string or a number) the assistant reply and the RL ground truth."""
    schema = f"{problem_key!r} and {answer_key!r} (strings; the answer may be a number)"

    def convert(row: Mapping[str, Any], index: int) -> Record:
        reader = _RowReader(row, index, source, schema)
        return _problem_and_answer(reader.text(problem_key), reader.text(answer_key))

    return convert


def verl_math_converter(source: str) -> RowConverter:
    """verl's math layout (DAPO-Math-17k, DAPO's AIME 2024): ``prompt`` (a message list; the content of its
    first message, the problem with DAPO's ``Answer:`` instruction, becomes the user turn) and
    ``reward_model`` (``{"ground_truth": ...}``, the answer). ``data_source``, ``ability`` and ``extra_info``
    are not read."""
    schema = "'prompt' (a list of {'role', 'content'} messages) and 'reward_model' ({'ground_truth': ...})"

    def convert(row: Mapping[str, Any], index: int) -> Record:
        reader = _RowReader(row, index, source, schema)
        if isinstance(row.get("prompt"), str):
            reader.fail("has 'prompt' as a string, expected a message list")
        problem = _messages(reader, "prompt", default_role="user")[0]["content"]
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, Mapping):
            reader.fail(f"has 'reward_model' {reward_model!r}, expected an object with 'ground_truth'")
        answer = _RowReader(reward_model, index, source, schema).text("ground_truth")
        return _problem_and_answer(problem, answer)

    return convert


def squad_converter(source: str) -> RowConverter:
    """SQuAD's schema: ``context`` becomes the system message, ``question`` the user turn and the first of
    ``answers`` (``{"text": [...]}``, a list of strings or a string) the assistant reply."""
    schema = "'context', 'question' (strings) and 'answers' ({'text': [...]} or a list of strings)"

    def convert(row: Mapping[str, Any], index: int) -> Record:
        reader = _RowReader(row, index, source, schema)
        context, question = reader.text("context"), reader.text("question")
        answers = row.get("answers")
        if isinstance(answers, Mapping):
            answers = answers.get("text")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not answers or not isinstance(answers[0], str):
            reader.fail(f"has no answer text in 'answers' (got {row.get('answers')!r})")
        answer: str = answers[0]
        return Record(
            messages=[
                ChatMessage(role="system", content=context),
                ChatMessage(role="user", content=question),
                ChatMessage(role="assistant", content=answer),
            ],
            expected_answer=answer,
        )

    return convert


def _messages(reader: _RowReader, key: str, *, default_role: str) -> list[ChatMessage]:
    """Field ``key`` as a message list: a string is one ``default_role`` turn, a list holds messages."""
    value = reader.row.get(key)
    if isinstance(value, str):
        return [ChatMessage(role=default_role, content=value)]
    if value is None:
        reader.fail(f"has no {key!r} string or message list (it has {sorted(reader.row)})")
    if not isinstance(value, list):
        reader.fail(f"has {key!r} of type {type(value).__name__}, expected a string or a message list")
    if not value:
        reader.fail(f"has an empty {key!r} message list")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            reader.fail(f"has message {i} of {key!r} of type {type(message).__name__}, expected an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            reader.fail(
                f"has message {i} of {key!r} without a string 'role' and 'content' (got {dict(message)!r})"
            )
        messages.append(ChatMessage(role=role, content=content))
    return messages


def openai_converter(source: str, chat_key: str) -> RowConverter:
    """Chat data: a list of ``{"role", "content"}`` messages under ``chat_key`` (and optionally an
    ``expected_answer`` field for RL, and a ``tools`` list of JSON schemas the conversation declares, as in
    OpenAI's fine-tuning files)."""
    schema = f"{chat_key!r}: a non-empty list of {{'role': ..., 'content': ...}} messages"

    def convert(row: Mapping[str, Any], index: int) -> Record:
        reader = _RowReader(row, index, source, schema)
        if row.get(chat_key) is None:
            reader.fail(f"has no message list under {chat_key!r} (it has {sorted(row)})")
        if not isinstance(row[chat_key], list):
            reader.fail(f"has {chat_key!r} of type {type(row[chat_key]).__name__}, expected a message list")
        record = Record(messages=_messages(reader, chat_key, default_role="user"))
        if reader.has("expected_answer"):
            record["expected_answer"] = reader.text("expected_answer")
        tools = row.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
                reader.fail(
                    f"has 'tools' of type {type(tools).__name__}, expected a list of JSON schema objects"
                )
            record["tools"] = [dict(t) for t in tools]
        return record

    return convert


def response_converter(source: str, input_key: str, output_key: str) -> RowConverter:
    """Input/output columns: ``input_key`` becomes the user turn, ``output_key`` the assistant reply and
    the RL ground truth."""
    schema = f"{input_key!r} and {output_key!r} (strings; set data.input_key / data.output_key)"

    def convert(row: Mapping[str, Any], index: int) -> Record:
        reader = _RowReader(row, index, source, schema)
        output = reader.text(output_key)
        return Record(
            messages=[
                ChatMessage(role="user", content=reader.text(input_key)),
                ChatMessage(role="assistant", content=output),
            ],
            expected_answer=output,
        )

    return convert


def preference_converter(source: str, prompt_key: str, chosen_key: str, rejected_key: str) -> RowConverter:
    """Binary preferences: a prompt (a string for one user turn, or a message list) and two responses
    (a string for one assistant turn, or a message list). ``messages`` becomes prompt + chosen and
    ``rejected_messages`` prompt + rejected."""
    schema = (
        f"{prompt_key!r} (a string or a message list) and {chosen_key!r}, {rejected_key!r} (strings or "
        "message lists; set data.prompt_key / data.chosen_key / data.rejected_key)"
    )

    def convert(row: Mapping[str, Any], index: int) -> Record:
        reader = _RowReader(row, index, source, schema)
        prompt = _messages(reader, prompt_key, default_role="user")
        chosen = _messages(reader, chosen_key, default_role="assistant")
        rejected = _messages(reader, rejected_key, default_role="assistant")
        return Record(messages=[*prompt, *chosen], rejected_messages=[*prompt, *rejected])

    return convert


def helpsteer3_converter(source: str) -> RowConverter:
    """HelpSteer3's preference schema: ``context`` (a string or a message list), ``response1``,
    ``response2`` and ``overall_preference`` (-3..3: negative prefers ``response1``, positive
    ``response2``). A tie (0) becomes a pair of two identical responses, which preference training masks
    out: it says nothing about which response is better."""
    schema = (
        "'context' (a string or a message list), 'response1', 'response2' (strings) and "
        "'overall_preference' (an integer, negative when response1 is preferred)"
    )

    def convert(row: Mapping[str, Any], index: int) -> Record:
        reader = _RowReader(row, index, source, schema)
        prompt = _messages(reader, "context", default_role="user")
        first, second = reader.text("response1"), reader.text("response2")
        preference = row.get("overall_preference")
        if isinstance(preference, bool) or not isinstance(preference, int | float):
            reader.fail(f"has 'overall_preference' {preference!r}, expected a number")
        if preference < 0:
            chosen, rejected = first, second
        elif preference > 0:
            chosen, rejected = second, first
        else:
            chosen = rejected = first
        return Record(
            messages=[*prompt, ChatMessage(role="assistant", content=chosen)],
            rejected_messages=[*prompt, ChatMessage(role="assistant", content=rejected)],
        )

    return convert


def tulu3_preference_converter(source: str) -> RowConverter:
    """Tulu 3's preference mixture: ``chosen`` and ``rejected`` whole conversations that share every message
    but the last, which is the assistant's response (``prompt`` is not read: it repeats the first turn)."""
    schema = (
        "'chosen' and 'rejected' (message lists that agree on all but their last message, an assistant "
        "response)"
    )

    def convert(row: Mapping[str, Any], index: int) -> Record:
        reader = _RowReader(row, index, source, schema)
        chosen = _messages(reader, "chosen", default_role="assistant")
        rejected = _messages(reader, "rejected", default_role="assistant")
        for key, conversation in (("chosen", chosen), ("rejected", rejected)):
            if len(conversation) < 2 or conversation[-1]["role"] != "assistant":
                reader.fail(f"has {key!r} that does not end with an assistant response after a prompt")
        if chosen[:-1] != rejected[:-1]:
            reader.fail("has 'chosen' and 'rejected' conversations with different prompts")
        return Record(messages=chosen, rejected_messages=rejected)

    return convert


def _check_parts(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise DataError(
            f"{where} has content of type {type(content).__name__}: give a string or a list of parts"
        )
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image" and part.get("image") is not None:
            continue
        raise DataError(
            f"{where} has a part {part!r}: parts are {{'type': 'text', 'text': ...}} or {{'type': 'image', "
            "'image': <path, bytes, PIL image or datasets Image>}"
        )


def vlm_converter(source: str, chat_key: str) -> RowConverter:
    """Multimodal chat rows: a message list under ``chat_key`` whose contents may hold image parts, and an
    optional ``expected_answer``. A malformed row raises a :class:`DataError` naming it."""

    def convert(row: Mapping[str, Any], index: int) -> Record:
        messages = row.get(chat_key) if isinstance(row, Mapping) else None
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{source}: row {index} has no message list under {chat_key!r}")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise DataError(f"{source}: row {index} message {i} needs a string 'role' and a 'content'")
            _check_parts(message.get("content"), f"{source}: row {index} message {i}")
        record: dict[str, Any] = {"messages": [dict(m) for m in messages]}
        if row.get("expected_answer") is not None:
            record["expected_answer"] = str(row["expected_answer"])
        # Record types its contents as text; a multimodal record holds parts (VlmRecord) and only the
        # multimodal processor reads it.
        return cast(Record, record)

    return convert


def clevr_cogent_converter(source: str) -> RowConverter:
    """CLEVR-CoGenT's schema: ``image`` (a ``datasets`` Image, a path or bytes), ``problem`` and ``solution``,
    whose answer is between ``<answer>`` tags (the whole solution when it has none). The image then the
    problem make the user turn, the answer the assistant reply and ``expected_answer``."""
    schema = "'image' (an image), 'problem' and 'solution' (strings)"

    def convert(row: Mapping[str, Any], index: int) -> Record:
        reader = _RowReader(row, index, source, schema)
        if row.get("image") is None:
            reader.fail(f"has no 'image' (it has {sorted(row)})")
        solution = reader.text("solution")
        tagged = re.search(r"<answer>(.*?)</answer>", solution, flags=re.DOTALL)
        answer = (tagged.group(1) if tagged else solution).strip()
        user = [{"type": "image", "image": row["image"]}, {"type": "text", "text": reader.text("problem")}]
        record = {
            "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            "expected_answer": answer,
        }
        return cast(Record, record)

    return convert


def converter_for(cfg: DataConfig, source: str, dataset_name: DatasetName | None = None) -> RowConverter:
    """The row converter of ``dataset_name`` (by default ``cfg.dataset_name``), with the column names of
    ``cfg`` (the multimodal chat one for ``openai_format`` with ``data.processor: vlm_hf_data_processor``);
    ``source`` names the data in error messages."""
    name = dataset_name or cfg.dataset_name
    if cfg.processor == "vlm_hf_data_processor" and name == "openai_format":
        return vlm_converter(source, cfg.chat_key)
    match name:
        case "tiny_math" | "OpenMathInstruct-2":
            return math_converter(source)
        case "DAPOMath17K" | "DAPOMathAIME2024":
            return verl_math_converter(source)
        case "DeepScaler" | "AIME2024":
            return answer_converter(source)
        case "squad":
            return squad_converter(source)
        case "openai_format":
            return openai_converter(source, cfg.chat_key)
        case "response":
            return response_converter(source, cfg.input_key, cfg.output_key)
        case "binary_preference":
            return preference_converter(source, cfg.prompt_key, cfg.chosen_key, cfg.rejected_key)
        case "tiny_math_preference":
            # Generated rows always use the default column names, whatever the data.*_key settings say.
            return preference_converter(source, "prompt", "chosen", "rejected")
        case "HelpSteer3":
            return helpsteer3_converter(source)
        case "Tulu3Preference":
            return tulu3_preference_converter(source)
        case "tiny_clevr":
            return vlm_converter(source, "messages")
        case "clevr-cogent":
            return clevr_cogent_converter(source)
