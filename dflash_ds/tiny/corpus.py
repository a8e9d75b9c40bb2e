"""The deterministic text the tiny tokenizer is trained on, and the tiny prompts tests and the demo ask."""

from __future__ import annotations

import random

_SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our team", "the model", "a student",
             "the old man", "this robot", "the river", "a small bird", "the engineer", "your sister",
             "the city", "a farmer", "the computer", "every child", "the train", "a doctor", "the sun"]
_VERBS = ["sees", "likes", "builds", "finds", "writes", "reads", "moves", "helps", "opens", "keeps",
          "makes", "takes", "wants", "knows", "learns", "plays with", "looks at", "thinks about",
          "runs to", "talks to"]
_OBJECTS = ["the red ball", "a long letter", "the green house", "some water", "the big tree",
            "a new book", "the blue car", "an apple", "the window", "a short story", "the garden",
            "a bright lamp", "the old bridge", "a warm coat", "the number seven", "a simple answer",
            "the next step", "a quiet room", "the first line", "a paper map"]
_ADVERBS = ["today", "every day", "in the morning", "at night", "again", "slowly", "quickly",
            "with care", "after lunch", "before dinner", "on monday", "right now"]
_QUESTIONS = ["What is {o}?", "Why does {s} like {o}?", "Can you describe {o}?",
              "How many {n} are there?", "Tell me about {s}.", "Where is {o}?",
              "Write a sentence about {s}.", "Explain why {s} {v} {o}."]
_SYLLABLES = ["ka", "lo", "mi", "ter", "su", "ran", "do", "vel", "ni", "bor", "qua", "zen", "pi", "hal",
              "mor", "ex", "tu", "gri", "sha", "wen", "ob", "lis", "cra", "fu", "den", "yo", "im", "pra"]
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def generate_corpus(num_lines: int = 6000, seed: int = 1234) -> list[str]:
    """Deterministic English-like lines: plain sentences, questions, and role-prefixed chat snippets."""
    rng = random.Random(seed)
    lines = []
    # Invented names give BPE enough distinct words to reach vocabularies of a few thousand tokens.
    names = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize() for _ in range(1500)]
    for i in range(num_lines):
        if i % 2:
            a, b = rng.choice(names), rng.choice(names)
            lines.append(f"{a} met {b} near {rng.choice(_OBJECTS)} {rng.choice(_ADVERBS)}.")
            continue
        s, v, o = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
        sentence = f"{s.capitalize()} {v} {o} {rng.choice(_ADVERBS)}."
        kind = (i // 2) % 4
        if kind == 0:
            lines.append(sentence)
        elif kind == 1:
            q = rng.choice(_QUESTIONS).format(s=s, v=v, o=o, n=rng.choice(_NUMBERS))
            lines.append(f"user\n{q}\nassistant\n{sentence} {rng.choice(_NUMBERS).capitalize()} times.")
        elif kind == 2:
            lines.append(f"system\nYou are a helpful assistant.\n{sentence}")
        else:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"{sentence} {a} + {b} = {a + b}, and {s} said: \"{o}!\"")
    return lines


def tiny_prompts(num: int = 64, seed: int = 0) -> list[dict]:
    """Deterministic OpenAI-form prompt rows (`{"id", "messages"}`, one user turn) for demos and tests."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        s, v, o = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
        question = rng.choice(_QUESTIONS).format(s=s, v=v, o=o, n=rng.choice(_NUMBERS))
        rows.append({"id": f"tiny-{seed}-{i}", "messages": [{"role": "user", "content": question}]})
    return rows
