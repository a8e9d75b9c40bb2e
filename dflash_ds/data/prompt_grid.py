"""Natural prompts: real questions of several task types for a real target to answer (`regenerate`); the
`make-prompts` command is natural_prompts.py, `self-instruct` seeds from these.

Each task type is a few templates crossed with topics (countries, processes, chores, sentences...); math word
problems draw their numbers from the seed. The split is by topic: a held-out prompt's topic (a country, a
word, one math problem) is in no training prompt, so held-out tau measures text the drafter has not seen the
target write about, not a rephrasing of a training question. Which topics are held out is seeded, taken
round-robin over the task types so every type is in the held-out set.

Templates ask for a paragraph, steps or a list, so a chat model's answers run past 60 tokens (SmolLM2-135M-
Instruct, greedy: median 202 of 24 held-out answers, 20 at 60 or more; docs/USAGE.md, "Natural prompts for it"); the
answers themselves come from `regenerate`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from pathlib import Path

from dflash_ds.errors import DFlashError

COUNTRIES = ["France", "Japan", "Brazil", "Egypt", "Canada", "India", "Italy", "Kenya", "Mexico", "Norway",
             "Peru", "Spain", "Thailand", "Germany", "Australia", "Argentina", "Greece", "Vietnam", "Morocco",
             "Sweden", "Chile", "Turkey", "Ireland", "Portugal", "Indonesia", "Nigeria", "Poland", "Iceland",
             "New Zealand", "South Korea"]
ANIMALS = ["elephant", "octopus", "penguin", "honeybee", "wolf", "dolphin", "owl", "camel", "kangaroo", "frog",
           "giraffe", "salmon", "bat", "tiger", "ant", "polar bear", "sea turtle", "chimpanzee", "eagle", "shark"]
CONCEPTS = ["photosynthesis", "the water cycle", "a rainbow", "vaccination", "the internet", "a refrigerator",
            "gravity", "electricity", "the immune system", "inflation", "a solar panel", "the heart",
            "compound interest", "recycling", "an earthquake", "the seasons", "a vaccine trial", "democracy",
            "a search engine", "the tides", "digestion", "a battery", "global warming", "a credit score",
            "sleep", "a bicycle gear", "the moon's phases", "a microwave oven", "evolution", "supply and demand"]
CHORES = ["boil an egg", "change a flat bicycle tire", "write a cover letter", "plant tomatoes", "make a budget",
          "clean a cast iron pan", "prepare for a job interview", "start running as a beginner",
          "make a cup of tea", "organize a small closet", "study for an exam", "bake bread at home",
          "back up the files on my computer", "learn a new language", "save money on groceries",
          "care for a houseplant", "give a short speech", "make a paper airplane", "wash a wool sweater",
          "set up a fish tank", "improve my handwriting", "plan a birthday party", "fall asleep faster",
          "write a thank-you note", "make a simple salad"]
SENTENCES = ["hey can u send me the report by tomorrow thanks", "The meeting got moved because the boss was sick.",
             "I think we should maybe try to fix the bug sometime soon.", "the food was ok but the service was slow",
             "We are going to the beach this weekend with our kids.", "Our team finishes the project next week.",
             "She walks to the library every morning.", "this phone is way too expensive for what it does",
             "The children play in the park after school.", "i cant come to the party cause im busy",
             "The new policy will help a lot of people save money.", "He forgot his keys again and was late.",
             "The results of the test were not very good.", "They build small boats in the old harbor.",
             "we need more coffee in the office asap", "The movie was long but the ending was great.",
             "I write emails to my customers every day.", "The train leaves at seven in the morning.",
             "my neighbor's dog barks all night and i cant sleep", "The company is hiring new engineers."]
COLLECTIONS = ["healthy breakfast foods", "board games for families", "ways to save energy at home",
               "famous painters", "hobbies you can do indoors", "tips for staying focused", "vegetables to grow in "
               "a garden", "classic novels", "exercises you can do without equipment", "ways to reduce stress",
               "inventions that changed the world", "skills every student should learn", "tourist sights in "
               "Europe", "ways to be a better listener", "musical instruments for beginners",
               "habits of productive people", "ideas for a rainy day", "things to pack for a camping trip",
               "programming languages", "ways to make a small room feel bigger"]
PAIRS = [("weather", "climate"), ("a virus", "a bacterium"), ("a crocodile", "an alligator"),
         ("a simile", "a metaphor"), ("RAM", "storage"), ("a lake", "a sea"), ("speed", "velocity"),
         ("a democracy", "a monarchy"), ("tea", "coffee"), ("a comet", "an asteroid"), ("a loan", "a grant"),
         ("baking soda", "baking powder"), ("an alto", "a soprano"), ("a fruit", "a vegetable"),
         ("a recession", "a depression"), ("an email", "a letter"), ("a frog", "a toad"),
         ("renting", "buying a home"), ("a rabbit", "a hare"), ("Python", "JavaScript")]
THEMES = ["the ocean", "autumn leaves", "a lost key", "a rainy morning", "the first day of school",
          "a lighthouse", "friendship", "a city at night", "an old tree", "a robot learning to paint",
          "the mountains", "a cat who wants to fly", "a summer storm", "a garden in spring", "the stars",
          "a kind stranger", "a small bakery", "the last train home", "a snowy village", "a message in a bottle"]
EMAILS = ["a landlord asking to fix a leaking sink", "a teacher asking for more time on an assignment",
          "a colleague thanking them for their help on a project", "a friend inviting them to a dinner party",
          "a customer apologizing for a late delivery", "a manager asking for a day off next Friday",
          "a neighbor about a package delivered to the wrong house", "a hotel asking about an early check-in",
          "a new team member welcoming them to the team", "a company asking about an open job position",
          "a store asking to return a broken lamp", "a coach saying your child will miss practice"]
WORDS = ["serendipity", "resilient", "ubiquitous", "meticulous", "ephemeral", "pragmatic", "eloquent",
         "ambiguous", "nostalgia", "candid", "diligent", "frugal", "tenacious", "benevolent", "curious",
         "empathy", "skeptical", "versatile", "humble", "vivid"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
              "returns the largest number in a list", "converts Celsius to Fahrenheit", "removes duplicates from "
              "a list", "checks whether a word is a palindrome", "computes the factorial of a number",
              "sums the even numbers in a list", "counts how often each word appears in a text"]

# task type -> (templates, topics). A template's {t} takes one topic; a pair fills {a} and {b}.
TASKS: dict[str, tuple[list[str], list]] = {
    "fact": (["Tell me about {t}: where it is, its capital city, and what it is famous for.",
              "What are three interesting facts about {t}?",
              "Describe the food and culture of {t}."], COUNTRIES),
    "animal": (["Describe the {t}: where it lives, what it eats, and how big it gets.",
                "What are some interesting facts about the {t}?"], ANIMALS),
    "explain": (["Explain {t} in simple terms.", "Why is it useful to understand {t}? Explain briefly.",
                 "Explain {t} to a ten-year-old."], CONCEPTS),
    "howto": (["How do I {t}? Give short step-by-step instructions.", "What are some tips to {t}?"], CHORES),
    "rewrite": (["Rewrite this sentence to sound more formal: \"{t}\"",
                 "Rewrite this sentence to be clearer and more polite, then explain what you changed: \"{t}\"",
                 "Write three different ways to say this sentence: \"{t}\""], SENTENCES),
    "list": (["List five {t} and say one sentence about each.",
              "Give me a short list of {t}, with a short note on each."],
             COLLECTIONS),
    "compare": (["What is the difference between {a} and {b}?",
                 "Compare {a} and {b}: how are they alike, and how are they different?"], PAIRS),
    "creative": (["Write a short poem about {t}.", "Write a short story, one paragraph long, about {t}."], THEMES),
    "email": (["Write a short, polite email to {t}."], EMAILS),
    "word": (["What does the word \"{t}\" mean? Give two example sentences.",
              "Explain the meaning of \"{t}\" and give a synonym and an antonym."], WORDS),
    "code": (["Write a Python function that {t}, and explain how it works.",
              "How would I write a Python function that {t}? Show the code."], CODE_TASKS),
}
MATH_TEMPLATES = [
    "A shop sells notebooks for ${p} each. Maria buys {n} notebooks and pays with a ${bill} bill. How much change "
    "does she get? Explain each step.",
    "A train travels at {s} kilometers per hour for {h} hours. How far does it go? Show your work.",
    "Tom has {n} apples. He gives {k} to his sister and buys {m} more. How many apples does he have now? "
    "Explain step by step.",
    "A rectangle is {w} meters wide and {l} meters long. What are its area and its perimeter? Show the steps.",
    "A class has {n} students and {k} of them are girls. What percentage of the class are boys? Explain how you "
    "get the answer.",
    "A recipe needs {k} eggs for {m} cookies. How many eggs are needed for {c} cookies? Solve it step by step.",
    "Sara saves ${p} every week. How many weeks does she need to save ${goal}? Explain your reasoning.",
    "A pizza is cut into {n} slices. Ali eats {k} slices and Ben eats {m}. What fraction of the pizza is left? "
    "Show your work.",
]
MATH_PER_TEMPLATE = 15


def _math_numbers(rng: random.Random) -> dict[str, int]:
    """Numbers every math template can take: positive answers, small enough to check by hand."""
    n = rng.randint(12, 40)
    k = rng.randint(2, n // 3)
    m = rng.randint(2, n // 3)
    p = rng.randint(2, 9)
    return {"p": p, "n": n, "bill": p * n + rng.choice([5, 10, 20]), "s": rng.randrange(40, 130, 5),
            "h": rng.randint(2, 6), "k": k, "m": m, "w": rng.randint(3, 15), "l": rng.randint(4, 25),
            "c": m * rng.randint(2, 5), "goal": p * rng.randint(6, 20)}


def natural_prompts(seed: int = 0) -> list[dict]:
    """Every prompt of the set: rows `{"id", "kind", "topic", "messages"}` (one user turn), in a fixed order."""
    rows = []

    def add(kind: str, topic: str, text: str) -> None:
        rid = f"{kind}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"  # stable: regenerate resumes by id
        rows.append({"id": rid, "kind": kind, "topic": topic, "messages": [{"role": "user", "content": text}]})

    for kind, (templates, topics) in TASKS.items():
        for topic in topics:
            for template in templates:
                if isinstance(topic, tuple):
                    add(kind, " / ".join(topic), template.format(a=topic[0], b=topic[1]))
                else:
                    add(kind, topic, template.format(t=topic))
    rng = random.Random(f"natural-prompts-math-{seed}")
    for i, template in enumerate(MATH_TEMPLATES):
        texts: set[str] = set()
        while len(texts) < MATH_PER_TEMPLATE:
            text = template.format(**_math_numbers(rng))
            if text not in texts:
                texts.add(text)
                add("math", f"math-{i}-{len(texts)}", text)  # each problem is its own topic
    return rows


def split_prompts(rows: list[dict], seed: int = 0, held_out: int = 64) -> tuple[list[dict], list[dict]]:
    """(train, held-out): seeded whole topics, each from the task type with the fewest held-out prompts so far,
    until `held_out` prompts (so the types are held out about equally, whatever their topics' sizes).

    Prompts of a held-out topic beyond `held_out` are in neither set, so no held-out topic reaches training.
    """
    if held_out < 1:
        raise DFlashError(f"--held-out {held_out}: must be >= 1")
    groups: dict[str, dict[str, list[dict]]] = {}
    for row in rows:
        groups.setdefault(row["kind"], {}).setdefault(row["topic"], []).append(row)
    rng = random.Random(f"natural-prompts-split-{seed}")
    queues = {kind: rng.sample(list(topics), len(topics)) for kind, topics in groups.items()}
    kinds = rng.sample(list(queues), len(queues))
    held, held_topics, per_kind = [], set(), Counter()
    while len(held) < held_out and any(queues.values()):
        kind = min((k for k in kinds if queues[k]), key=lambda k: per_kind[k])  # ties: the seeded order
        topic = queues[kind].pop()
        held_topics.add((kind, topic))
        taken = groups[kind][topic][: held_out - len(held)]
        held += taken
        per_kind[kind] += len(taken)
    if len(held) < held_out:
        raise DFlashError(f"--held-out {held_out}: the set has only {len(rows)} prompts")
    train = [r for r in rows if (r["kind"], r["topic"]) not in held_topics]
    return rng.sample(train, len(train)), held


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Rows as JSONL (the `regenerate` / `eval` input form), written whole then renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
