"""Long conversations assembled from the user's own chats: whole user/assistant pairs, chained.

Served prompts are long (agentic sessions, many turns of one chat), and the data users have is
mostly short. Two things are built from the same turns here, by the same code:

- the long evaluation prompts (`evaluate.context_prompts`): a question after earlier pairs of the
  other conversations, as many as fit in the context length;
- the training sessions of `--session-tokens N`: the pairs of the conversations, in their order,
  chained into conversations of about N tokens each.

A pair is a user turn and the assistant answer right after it; nothing is ever cut inside a turn.
Pairs are taken in order; one that does not fit in what is left is passed over (it opens a later
session) and the search gives up after `MAX_MISSES` misfits in a row. The token counts are the
caller's (`render`: the messages as the token ids the caller will use), and the whole result is
rendered once at the end and its last pairs dropped while it is over: the bound always holds.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

__all__ = [
    "MAX_MISSES",
    "Message",
    "Pair",
    "assemble_sessions",
    "fill_with_pairs",
    "fit_whole",
    "turn_pairs",
]

logger = logging.getLogger(__name__)

Message = dict[str, str]
Pair = list[Message]
Render = Callable[[list[Message]], list[int]]
# Pairs in a row that may not fit before the search for more gives up.
MAX_MISSES = 16


def turn_pairs(messages: Sequence[Message]) -> Iterator[Pair]:
    """The conversation's user turns each with the assistant answer that follows it."""
    for first, second in zip(messages, messages[1:]):
        if first["role"] == "user" and second["role"] == "assistant":
            yield [first, second]


def fill_with_pairs(pairs: Iterable[Pair], cost: Callable[[Pair], int], budget: int) -> list[Pair]:
    """The pairs, in order, whose costs fit in `budget` tokens together.

    A pair that does not fit in what is left is passed over; the search ends when nothing is
    left or `MAX_MISSES` pairs in a row did not fit (so a nearly full budget does not read the
    whole data). `cost` is what the pair adds to the rendered result.
    """
    chosen: list[Pair] = []
    misses = 0
    for pair in pairs:
        if budget <= 0 or misses >= MAX_MISSES:
            break
        price = cost(pair)
        if price > budget:
            misses += 1
            continue
        chosen.append(pair)
        budget -= price
        misses = 0
    return chosen


def fit_whole(
    chosen: list[Pair],
    render: Render,
    length: int,
    before: Sequence[Message] = (),
    after: Sequence[Message] = (),
) -> list[int]:
    """`before`, the chosen pairs, `after`, rendered whole; the last pairs are dropped (from
    `chosen`, in place) while the result is over `length` tokens. Its token ids."""
    while True:
        ids = render([*before, *(m for pair in chosen for m in pair), *after])
        if len(ids) <= length or not chosen:
            return ids
        chosen.pop()


def assemble_sessions(
    conversations: Sequence[Sequence[Message]], render: Render, length: int
) -> list[list[Message]]:
    """The pairs of `conversations`, in order, chained into sessions of at most `length` tokens.

    Each pair is used once at most: a session takes the pairs that fit, the ones passed over
    open the next session (so no pair waits long), and a session is filled again with what its
    first estimate left free (each pair rendered alone counts the template's header once more
    than it costs inside the session). A pair longer than `length` on its own is left out and
    counted in a warning. System turns are not part of any pair: sessions have none. A session of
    one pair only is left out too (it is no longer than the conversation it comes from).
    """
    pairs = [pair for messages in conversations for pair in turn_pairs(messages)]
    # Each pair rendered once, by identity: `pairs` keeps every pair alive, so no id is reused.
    costs = {id(pair): len(render(pair)) for pair in pairs}

    def cost(pair: Pair) -> int:
        return costs[id(pair)]

    too_long = sum(cost(pair) > length for pair in pairs)
    pool = deque(pair for pair in pairs if cost(pair) <= length)
    sessions: list[list[Message]] = []
    while pool:
        chosen: list[Pair] = []
        used = 0
        while pool:
            taken: list[Pair] = []
            added = fill_with_pairs(_draining(pool, taken), cost, length - used)
            picked = {id(pair) for pair in added}
            pool.extendleft(reversed([pair for pair in taken if id(pair) not in picked]))
            if not added:
                break
            chosen += added
            before = list(chosen)
            used = len(fit_whole(chosen, render, length))
            if len(chosen) < len(before):  # it was over: the dropped pairs go back; it is full
                pool.extendleft(reversed(before[len(chosen) :]))
                break
        if not chosen:  # nothing fits an empty session: only pairs over `length`, left out above
            break
        if len(chosen) > 1:
            sessions.append([message for pair in chosen for message in pair])
    if too_long:
        logger.warning(
            "%d user/assistant pairs are longer than a session's %d tokens on their own and are "
            "in no session",
            too_long,
            length,
        )
    return sessions


def _draining(pool: deque[Pair], taken: list[Pair]) -> Iterator[Pair]:
    """The pool's pairs from the front, each removed as it is read and noted in `taken`."""
    while pool:
        pair = pool.popleft()
        taken.append(pair)
        yield pair
