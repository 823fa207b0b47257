"""Chat data -> token ids and loss masks for EAGLE-3 training.

Conversations in ShareGPT shape (`{"from": "human"|"gpt", "value": ...}`) or UltraChat/OpenAI shape
(`{"role": ..., "content": ...}`) are rendered with the target tokenizer's chat template. The loss
mask is 1 exactly on the tokens each assistant turn adds: its content and the end-of-turn marker the
template writes after it, found by rendering the conversation turn by turn (or, with
`assistant_pattern`, by a regex whose first group is the assistant text). Rows that cannot be used
are skipped, counted, and named in a warning.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from datasets import Dataset as HFDataset
from transformers import PreTrainedTokenizer

from speculators_vllm016.data_generation.configs import DATASET_CONFIGS
from speculators_vllm016.data_generation.conversations import (
    MalformedRowError,
    conversation_of,
    normalize_conversation,
    skip_reason,
)
from speculators_vllm016.utils.errors import InvalidInputError, type_and_first_line
from speculators_vllm016.utils.stop_signals import ctrl_c_left_to_this_process

__all__ = [
    "PreprocessResult",
    "build_eagle3_dataset",
    "load_and_preprocess",
    "load_and_preprocess_dataset",
    "load_chat_tokenizer",
    "load_raw_dataset",
    "preprocess_conversations",
]

logger = logging.getLogger(__name__)

ROW_COLUMN = "source_row"
_MAX_NAMED_ROWS = 20


@dataclass(frozen=True)
class PreprocessResult:
    """What preprocessing produced: the usable samples and how many rows it dropped.

    `dataset` has `input_ids` and `loss_mask` (torch format) and `source_row`; `skipped_rows`
    counts rows dropped as unusable (malformed, no assistant token left after truncation, ...).
    `tokenizer` is set by `load_and_preprocess`, which loads it.
    """

    dataset: HFDataset
    skipped_rows: int
    tokenizer: PreTrainedTokenizer | None = None


def drop_turns(messages: list[dict[str, str]], rng: random.Random) -> list[dict[str, str]]:
    """Turn dropout: keep the first N turns, N random, ending on an assistant turn."""
    ends = [index + 1 for index, message in enumerate(messages) if message["role"] == "assistant"]
    return messages[: rng.choice(ends)]


def _render(
    tokenizer: PreTrainedTokenizer,
    messages: list[dict],
    generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The template's text; `template_kwargs` (`--chat-template-kwargs`) go to the template as
    they go to it when the target answers (regeneration), or nothing when there are none."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **(template_kwargs or {})
    )
    assert isinstance(text, str)
    return text


def assistant_spans_from_template(
    tokenizer: PreTrainedTokenizer,
    messages: list[dict[str, str]],
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return the text and the character spans of assistant turns.

    Each assistant turn's span runs from the end of the prompt rendered with the generation prompt
    (`messages[:k]`) to the end of `messages[:k+1]`, without the whitespace the template puts
    between turns. This needs a template whose renderings of shorter prefixes are prefixes of the
    full text, which holds for the common templates; one that is not raises `MalformedRowError`.
    """
    text = _render(tokenizer, messages, False, template_kwargs)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], True, template_kwargs) if index else ""
        through = _render(tokenizer, messages[: index + 1], False, template_kwargs)
        if not (text.startswith(through) and through.startswith(before)):
            raise MalformedRowError(
                "the chat template does not render this conversation prefix-stably; pass "
                "assistant_pattern to mark assistant text"
            )
        end = len(through.rstrip())
        spans.append((len(before), max(end, len(before))))
    return text, spans


def assistant_spans_from_pattern(
    tokenizer: PreTrainedTokenizer,
    messages: list[dict[str, str]],
    pattern: re.Pattern,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; the pattern's first group (or whole match) is assistant text."""
    text = _render(tokenizer, messages, False, template_kwargs)
    group = 1 if pattern.groups else 0
    spans = [match.span(group) for match in pattern.finditer(text)]
    return text, spans


def tokens_in_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap an assistant span, else 0."""
    mask = [0] * len(offsets)
    starts = [start for start, _ in offsets]
    for span_start, span_end in spans:
        first = max(0, bisect.bisect_right(starts, span_start) - 1)
        for index in range(first, len(offsets)):
            token_start, token_end = offsets[index]
            if token_start >= span_end:
                break
            if token_end > span_start and token_end > token_start:
                mask[index] = 1
    return mask


def tokenize_conversation(
    tokenizer: PreTrainedTokenizer,
    messages: list[dict[str, str]],
    max_length: int,
    pattern: re.Pattern | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one conversation, truncated to `max_length` tokens."""
    if pattern is None:
        text, spans = assistant_spans_from_template(tokenizer, messages, template_kwargs)
    else:
        text, spans = assistant_spans_from_pattern(tokenizer, messages, pattern, template_kwargs)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])[:max_length]
    mask = tokens_in_spans(list(encoding["offset_mapping"]), spans)[:max_length]
    if not any(mask):
        raise MalformedRowError(
            "no assistant token left"
            + (" after truncation" if spans else " (pattern matched nothing)")
        )
    return input_ids, mask


def _preprocess_rows(
    batch: dict[str, list],
    tokenizer: PreTrainedTokenizer,
    max_length: int,
    pattern: str | None,
    turn_dropout: bool,
    seed: int,
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, list]:
    compiled = re.compile(pattern, re.DOTALL) if pattern else None
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], ROW_COLUMN: [], "error": []}
    for row, turns in zip(batch[ROW_COLUMN], batch["conversations"]):
        try:
            messages = normalize_conversation(turns)
            if turn_dropout:
                messages = drop_turns(messages, random.Random(f"{seed}:{row}"))
            input_ids, mask = tokenize_conversation(
                tokenizer, messages, max_length, compiled, template_kwargs
            )
            error = ""
        except MalformedRowError as exc:
            input_ids, mask, error = [], [], str(exc)
        except Exception as exc:  # noqa: BLE001 - a template error in one row must not stop a run
            input_ids, mask, error = [], [], f"{type(exc).__name__}: {exc}"
        out["input_ids"].append(input_ids)
        out["loss_mask"].append(mask)
        out[ROW_COLUMN].append(row)
        out["error"].append(error)
    return out


def _ensure_conversations(dataset: HFDataset) -> HFDataset:
    """The turns of every row in one `conversations` column (see `conversation_of`)."""
    columns = dataset.column_names
    if "conversations" in columns and "messages" in columns:
        # A file mixing both shapes: each row's own turns, JSON-encoded as their shapes differ.
        return dataset.map(
            lambda row: {"conversations": json.dumps(conversation_of(row))},
            remove_columns=["messages"],
            desc="Reading conversations",
        )
    if "conversations" in columns:
        return dataset
    if "messages" in columns:
        return dataset.rename_column("messages", "conversations")
    raise InvalidInputError(
        f"the dataset has no 'conversations' or 'messages' column (columns: {dataset.column_names})"
    )


def build_eagle3_dataset(
    dataset: HFDataset,
    tokenizer: PreTrainedTokenizer,
    max_length: int = 2048,
    num_proc: int = 8,
    assistant_pattern: str | None = None,
    turn_dropout: bool = False,
    *,
    seed: int = 0,
) -> HFDataset:
    """0.3.0's entry point: `preprocess_conversations(...).dataset`."""
    return preprocess_conversations(
        dataset, tokenizer, max_length, num_proc, assistant_pattern, turn_dropout, seed=seed
    ).dataset


def preprocess_conversations(
    dataset: HFDataset,
    tokenizer: PreTrainedTokenizer,
    max_length: int = 2048,
    num_proc: int = 8,
    assistant_pattern: str | None = None,
    turn_dropout: bool = False,
    *,
    seed: int = 0,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> PreprocessResult:
    """Tokenize conversations into `input_ids` and `loss_mask` (torch format).

    `chat_template_kwargs` go to every rendering of the template (None: none, as in 0.3.0).

    Malformed rows are dropped with a warning naming them (by `source_row`, the row's index in
    the raw dataset) and counted in the result; a `ValueError` is raised only when no row is
    usable.
    """
    if tokenizer.chat_template is None:
        raise InvalidInputError("the tokenizer has no chat template; one is needed to render chats")
    if assistant_pattern is not None:
        re.compile(assistant_pattern)  # a bad pattern fails here, not in every worker
    dataset = _ensure_conversations(dataset)
    if ROW_COLUMN not in dataset.column_names:
        dataset = dataset.add_column(ROW_COLUMN, list(range(len(dataset))))
    workers = max(1, min(num_proc, os.cpu_count() or 1, len(dataset) // 256 or 1))
    with ctrl_c_left_to_this_process():  # a worker prints no traceback of its own
        processed = dataset.map(
            _preprocess_rows,
            batched=True,
            batch_size=256,
            num_proc=workers if workers > 1 else None,
            remove_columns=dataset.column_names,
            fn_kwargs={
                "tokenizer": tokenizer,
                "max_length": max_length,
                "pattern": assistant_pattern,
                "turn_dropout": turn_dropout,
                "seed": seed,
                "template_kwargs": chat_template_kwargs,
            },
            desc="Tokenizing conversations",
        )
    errors = [
        (row, error) for row, error in zip(processed[ROW_COLUMN], processed["error"]) if error
    ]
    if errors:
        reasons = Counter(skip_reason(error) for _, error in errors)
        named = "; ".join(f"{_row_name(row)}: {error}" for row, error in errors[:_MAX_NAMED_ROWS])
        more = (
            f" (and {len(errors) - _MAX_NAMED_ROWS} more)" if len(errors) > _MAX_NAMED_ROWS else ""
        )
        logger.warning(
            "skipped %d of %d conversations as malformed: %s%s. Reasons: %s",
            len(errors),
            len(processed),
            named,
            more,
            dict(reasons),
        )
    if len(errors) == len(processed):
        raise InvalidInputError(
            f"none of the {len(processed)} conversations is usable; first problems: "
            + "; ".join(f"{_row_name(row)}: {error}" for row, error in errors[:5])
        )
    good = processed.filter(lambda error: not error, input_columns="error")
    good = good.remove_columns("error")
    good.set_format(type="torch", columns=["input_ids", "loss_mask"], output_all_columns=True)
    return PreprocessResult(dataset=good, skipped_rows=len(errors))


def _row_name(row: int) -> str:
    """A sample's source in messages: its row of the data, or the session (`session_dataset`)."""
    return f"row {row}" if row >= 0 else f"session {-row}"


def _load_json_rows(path: str) -> HFDataset:
    """Rows of a json/jsonl file with each conversation JSON-encoded, whatever its shape."""
    if path.endswith(".jsonl"):
        rows = []
        with open(path) as handle:
            for line in handle:
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        rows.append(line)  # kept, then reported as not valid JSON
    else:
        with open(path) as handle:
            try:
                rows = json.load(handle)
            except json.JSONDecodeError as exc:
                raise InvalidInputError(
                    f"{path} is not valid JSON (line {exc.lineno}: {exc.msg}); fix the file or "
                    "write it as JSON lines (.jsonl), one conversation a line"
                ) from None
    if not isinstance(rows, list):
        raise InvalidInputError(f"{path} must hold a list of conversations")
    conversations = []
    for row in rows:
        turns = conversation_of(row)
        if isinstance(turns, str) and not _is_json(turns):
            # a text where the turns belong, as in {"conversations": "oops"}: encoded, so the row
            # is reported for what it is (not a list of turns), not as a line of bad JSON
            turns = json.dumps(turns) if not isinstance(row, str) else turns
        conversations.append(turns if isinstance(turns, str) else json.dumps(turns))
    return HFDataset.from_dict({"conversations": conversations})


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def check_utf8(path: str) -> None:
    """Refuse a chat file that is not UTF-8 text, naming its first bad line: read as bytes, such a
    file loads, and fails later with the decoder's message and no file name."""
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise InvalidInputError(
                    f"{path} is not UTF-8 text (line {number}, byte {error.start + 1} of the line: "
                    f"{line[error.start : error.start + 1]!r}); save the file as UTF-8"
                ) from None


def load_raw_dataset(
    train_data_path: str,
    num_proc: int = 8,
    cache_dir: str | None = None,
    flag: str = "--train-data-path",
) -> HFDataset:
    """A local .json/.jsonl file, or a named dataset from `DATASET_CONFIGS` (needs the hub).
    `flag`: the calling command's name for the path, which its errors name (eval: --data-path)."""
    from datasets import load_dataset

    if train_data_path.endswith((".json", ".jsonl")):
        if not os.path.isfile(train_data_path):
            raise FileNotFoundError(f"no data file at {train_data_path}; check {flag}")
        check_utf8(train_data_path)
        from datasets.utils import logging as datasets_logging

        verbosity = datasets_logging.get_verbosity()
        # A file Arrow refuses is read row by row below: datasets' own ERROR line about it
        # (with pyarrow's message) would come before the one warning that says so.
        datasets_logging.set_verbosity(logging.CRITICAL)
        try:
            return load_dataset(
                "json", data_files=train_data_path, split="train", cache_dir=cache_dir
            )
        except Exception as exc:  # noqa: BLE001 - Arrow refuses rows of mixed shapes
            logger.warning(
                "%s does not load as one Arrow table (%s); reading it row by row",
                train_data_path,
                type(exc).__name__,
            )
            return _load_json_rows(train_data_path)
        finally:
            datasets_logging.set_verbosity(verbosity)
    config = DATASET_CONFIGS.get(train_data_path)
    if config is None:
        raise InvalidInputError(
            f"unknown dataset {train_data_path!r} ({flag}): pass a local .json/.jsonl file or one of "
            f"{sorted(DATASET_CONFIGS)}"
        )
    dataset = load_dataset(config.hf_path, split=config.split, cache_dir=cache_dir)
    if config.normalize_fn is not None:
        with ctrl_c_left_to_this_process():
            dataset = dataset.map(
                config.normalize_fn, num_proc=max(1, min(num_proc, os.cpu_count() or 1))
            )
        if "conversations" in dataset.column_names and "messages" in dataset.column_names:
            dataset = dataset.remove_columns("messages")  # now copied into "conversations"
    return dataset


def load_and_preprocess_dataset(
    target_model_path: str,
    train_data_path: str,
    seq_length: int,
    build_dataset_num_proc: int = 8,
    seed: int = 0,
    max_samples: int | None = None,
    token_freq_path: str | None = "./token_freq.pt",
    cache_dir: str | None = None,
    assistant_pattern: str | None = None,
    turn_dropout: bool = False,
    trust_remote_code: bool = False,
) -> tuple[HFDataset, PreTrainedTokenizer]:
    """0.3.0's entry point: `load_and_preprocess(...)` as `(dataset, tokenizer)`."""
    result = load_and_preprocess(
        target_model_path,
        train_data_path,
        seq_length,
        build_dataset_num_proc=build_dataset_num_proc,
        seed=seed,
        max_samples=max_samples,
        token_freq_path=token_freq_path,
        cache_dir=cache_dir,
        assistant_pattern=assistant_pattern,
        turn_dropout=turn_dropout,
        trust_remote_code=trust_remote_code,
    )
    return result.dataset, result.tokenizer


def session_dataset(
    raw: HFDataset,
    tokenizer: PreTrainedTokenizer,
    length: int,
    template_kwargs: dict[str, Any] | None = None,
) -> HFDataset:
    """The sessions of `raw`'s conversations (`sessions.assemble_sessions`, at most `length`
    tokens as the template renders them), as rows to preprocess: session k (from 1) is source
    row -k. Malformed rows give no pairs (preprocessing names them)."""
    from speculators_vllm016.data_generation.sessions import assemble_sessions

    conversations = []
    for turns in _ensure_conversations(raw)["conversations"]:
        try:
            conversations.append(normalize_conversation(turns))
        except MalformedRowError:
            continue

    def render(messages: list[dict[str, str]]) -> list[int]:
        text = _render(tokenizer, messages, False, template_kwargs)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    sessions = assemble_sessions(conversations, render, length)
    if not sessions:
        raise InvalidInputError(
            f"no session of two or more user/assistant pairs fits --session-tokens {length} "
            f"from {len(conversations)} conversations; raise --session-tokens or add data"
        )
    logger.info(
        "%d sessions of at most %d tokens chained from %d conversations",
        len(sessions),
        length,
        len(conversations),
    )
    return HFDataset.from_dict(
        {
            "conversations": [json.dumps(session) for session in sessions],
            ROW_COLUMN: [-k for k in range(1, len(sessions) + 1)],
        }
    )


def _joined(results: list[PreprocessResult]) -> PreprocessResult:
    """The conversations' samples, then the sessions' (one result as it is)."""
    if len(results) == 1:
        return results[0]
    from datasets import concatenate_datasets

    dataset = concatenate_datasets([result.dataset for result in results])
    dataset.set_format(type="torch", columns=["input_ids", "loss_mask"], output_all_columns=True)
    return PreprocessResult(dataset, sum(result.skipped_rows for result in results))


def load_chat_tokenizer(target_model_path: str, trust_remote_code: bool = False):
    """The target's tokenizer, with a pad token and a chat template (refused without one).

    A model that needs its own Python is named with the flag that allows it; any other failure
    is one line naming the model.
    """
    from transformers import AutoTokenizer

    from speculators_vllm016.utils.verifier_config import remote_code_hint

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            target_model_path, trust_remote_code=trust_remote_code
        )
    except Exception as error:  # noqa: BLE001 - translated when it asks for remote code
        hint = remote_code_hint(error, target_model_path)
        if hint is not None:
            raise hint from None
        raise InvalidInputError(
            f"cannot load the tokenizer of {target_model_path} ({type_and_first_line(error)})"
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise InvalidInputError(
            f"the tokenizer of {target_model_path} has no chat template; a chat model is needed"
        )
    return tokenizer


def load_and_preprocess(
    target_model_path: str,
    train_data_path: str,
    seq_length: int,
    build_dataset_num_proc: int = 8,
    seed: int = 0,
    max_samples: int | None = None,
    token_freq_path: str | None = "./token_freq.pt",
    cache_dir: str | None = None,
    assistant_pattern: str | None = None,
    turn_dropout: bool = False,
    trust_remote_code: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    session_tokens: int = 0,
    sessions_only: bool = False,
) -> PreprocessResult:
    """Load, shuffle (by `seed`), cap at `max_samples`, tokenize (the template rendered with
    `chat_template_kwargs`); save token frequencies.

    `session_tokens` > 0: after the conversations (none with `sessions_only`) come sessions of
    at most that many tokens chained from their pairs (`sessions.assemble_sessions`, in the
    shuffled order, so `seed` decides them too). `token_freq_path=None` skips the counts
    (datagen writes them itself, once the run is accepted). The model folder's own Python runs
    only with `trust_remote_code=True`.
    """
    from speculators_vllm016.data_generation.token_counts import (
        count_trained_tokens,
        save_token_counts,
    )

    tokenizer = load_chat_tokenizer(target_model_path, trust_remote_code)
    raw = _ensure_conversations(
        load_raw_dataset(train_data_path, build_dataset_num_proc, cache_dir)
    )
    if len(raw) == 0:
        raise InvalidInputError(
            f"{train_data_path} holds no conversations; check --train-data-path"
        )
    raw = raw.add_column(ROW_COLUMN, list(range(len(raw))))
    raw = raw.shuffle(seed=seed)
    if max_samples is not None and len(raw) > max_samples:
        raw = raw.select(range(max_samples))
    parts = [] if sessions_only else [raw]
    if session_tokens:
        parts.append(session_dataset(raw, tokenizer, session_tokens, chat_template_kwargs))
    results = [
        preprocess_conversations(
            part,
            tokenizer,
            max_length=seq_length,
            num_proc=build_dataset_num_proc,
            assistant_pattern=assistant_pattern,
            turn_dropout=turn_dropout,
            seed=seed,
            chat_template_kwargs=chat_template_kwargs,
        )
        for part in parts
    ]
    result = _joined(results)
    if token_freq_path is not None:
        save_token_counts(count_trained_tokens(result.dataset), token_freq_path)
    return PreprocessResult(result.dataset, result.skipped_rows, tokenizer)
