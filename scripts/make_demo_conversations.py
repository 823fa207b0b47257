#!/usr/bin/env python3
"""Writes speculators_vllm016/demo/conversations.jsonl: the demo's shipped chat data.

Deterministic (seeded) synthetic conversations in ShareGPT shape: varied topics, lengths and turn
counts, some with a system prompt. Run again only to change the data; the output is committed.
"""

import json
import random
from pathlib import Path

TOPICS = {
    "cooking": ["pasta", "bread", "curry", "soup", "salad", "pancakes", "risotto", "dumplings"],
    "travel": ["Lisbon", "Kyoto", "the Alps", "Patagonia", "Iceland", "Morocco", "Vietnam"],
    "programming": ["recursion", "hash maps", "unit tests", "async code", "memory leaks", "regex"],
    "science": ["photosynthesis", "black holes", "vaccines", "plate tectonics", "entropy", "DNA"],
    "history": ["the Roman roads", "the printing press", "the Silk Road", "the steam engine"],
    "fitness": ["running", "swimming", "stretching", "strength training", "cycling", "yoga"],
    "finance": ["budgeting", "compound interest", "index funds", "emergency savings", "taxes"],
    "music": ["the guitar", "jazz chords", "piano scales", "rhythm", "songwriting", "choirs"],
}
OPENERS = [
    "Can you explain {x} to me?",
    "What should a beginner know about {x}?",
    "I keep getting confused by {x}. Help?",
    "Give me three tips about {x}.",
    "Why does {x} matter?",
    "Write a short note on {x} for a friend.",
    "How would you teach {x} to a child?",
    "What is a common mistake with {x}?",
]
FOLLOWUPS = [
    "Can you say more about the second point?",
    "Give me an example.",
    "Make it shorter, please.",
    "What would an expert add?",
    "How long does it take to get good at it?",
    "Is there anything to avoid?",
    "Summarize that in one sentence.",
    "Thanks! One more question: why?",
]
FACTS = [
    "Start small and repeat the basics until they feel easy.",
    "Write down what you try, so you can see what works.",
    "Most progress comes from steady practice, not from rare long sessions.",
    "Ask someone experienced to look at your work early.",
    "Measure before you change anything, then measure again.",
    "Good tools help, but habits matter more.",
    "Break the problem into parts and handle one part at a time.",
    "Rest is part of the process; tired people make more mistakes.",
    "Compare two approaches side by side before choosing one.",
    "Keep notes of questions you cannot answer yet.",
]
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise tutor. Answer clearly.",
    "You are a friendly expert who gives practical advice.",
]


def answer(rng: random.Random, subject: str) -> str:
    sentences = [f"Here is how I think about {subject}."]
    sentences += rng.sample(FACTS, k=rng.randint(1, 6))
    if rng.random() < 0.4:
        sentences.append(f"In short: {subject} rewards patience.")
    steps = rng.randint(0, 4)
    for step in range(1, steps + 1):
        sentences.append(f"Step {step}: {rng.choice(FACTS).lower()}")
    return " ".join(sentences)


def conversation(rng: random.Random) -> dict:
    topic = rng.choice(sorted(TOPICS))
    subject = rng.choice(TOPICS[topic])
    turns = []
    if rng.random() < 0.3:
        turns.append({"from": "system", "value": rng.choice(SYSTEMS)})
    turns.append({"from": "human", "value": rng.choice(OPENERS).format(x=subject)})
    turns.append({"from": "gpt", "value": answer(rng, subject)})
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        turns.append({"from": "human", "value": rng.choice(FOLLOWUPS)})
        turns.append({"from": "gpt", "value": answer(rng, subject)})
    return {"topic": topic, "conversations": turns}


def main() -> None:
    rng = random.Random(20261129)
    out = (
        Path(__file__).resolve().parents[1] / "speculators_vllm016" / "demo" / "conversations.jsonl"
    )
    with open(out, "w") as handle:
        for index in range(320):
            row = {"id": f"demo-{index:04d}", **conversation(rng)}
            handle.write(json.dumps(row) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
