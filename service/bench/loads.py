"""The prompts of `textgen bench`'s built-in loads (`--load`).

- chat: short questions, answered in new words: the output repeats little of the prompt.
- copy: input-grounded work, where the output repeats long runs of the prompt: a code file
  or a passage to write out again with a small edit, records to extract as JSON. Written as
  completions (an instruction, the text, and the start of the answer), so a base or an
  instruct model continues by copying. Speculative decoding's n-gram lookup proposes those
  runs for free; the chat load shows what it costs where it finds little.
"""

from __future__ import annotations

CHAT = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a transformer language model generates text, step by step.",
    "List three uses of Python in science.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the benefits of regular exercise for mental health and for the body?",
    "Translate 'good morning, how are you today?' into French.",
    "How do vaccines train the immune system?",
    "Describe the water cycle.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves falling in the quiet park.",
    "Explain recursion to a ten year old.",
    "What causes the seasons on Earth?",
    "Suggest a name for a friendly robot.",
]

_INVENTORY = '''def restock(inventory, orders, threshold=5):
    """Return the items to reorder and how many of each."""
    to_order = {}
    for item, count in inventory.items():
        pending = orders.get(item, 0)
        if count + pending < threshold:
            to_order[item] = threshold * 2 - count - pending
    return to_order


def total_value(inventory, prices):
    total = 0
    for item, count in inventory.items():
        total += count * prices.get(item, 0)
    return total
'''

_STATS = """import math


def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def standard_deviation(values):
    return math.sqrt(variance(values))


def zscores(values):
    m, s = mean(values), standard_deviation(values)
    return [(v - m) / s for v in values]
"""

_SERVER = """class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word):
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n):
        ranked = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return ranked[:n]


def count_words(text):
    counter = Counter()
    for word in text.lower().split():
        counter.add(word.strip(".,;:!?"))
    return counter
"""

_LIGHTHOUSE = (
    "The lighthouse at Carrow Point was built in 1871 by the engineer Thomas Harlow. It "
    "stands forty meters tall on a ledge of dark granite, and its lamp could be seen from "
    "twenty miles out to sea. For ninety years a keeper lived in the small stone cottage at "
    "its foot, climbing the spiral stairs each evening to light the lamp and each morning to "
    "polish the great glass lens. In 1962 the light was automated, and the last keeper, "
    "Margaret Ellis, moved to the village of Carrow, where she taught at the school until "
    "she retired."
)

_MARKET = (
    "Every Saturday the market square in Lindenfeld fills with stalls before sunrise. "
    "Farmers from the valley bring apples, pears, cabbages and potatoes; a baker from the "
    "next town sells rye bread and honey cake; and an old man named Josef Brandt repairs "
    "clocks at a folding table by the fountain. By noon the square is crowded with families, "
    "and by three o'clock the stalls are packed away and the square is quiet again."
)

_RECORDS = (
    "Anna Weber is 34 and lives in Hamburg. "
    "Luis Ortega is 51 and lives in Valencia. "
    "Mei Tanaka is 28 and lives in Osaka. "
    "Samuel Okafor is 45 and lives in Lagos. "
    "Ingrid Holm is 39 and lives in Oslo."
)


def _edit(instruction: str, code: str, answer: str = "After") -> str:
    return f"{instruction}\n\nBefore:\n```python\n{code}```\n\n{answer}:\n```python\n"


COPY = [
    _edit("Rename the function restock to plan_restock. Change nothing else.", _INVENTORY),
    _edit("Add a docstring to the function mean. Keep the rest of the file as it is.", _STATS),
    _edit("Rename the class Counter to WordCounter. Change nothing else.", _SERVER),
    _edit("Copy the following code exactly.", _INVENTORY, "Copy"),
    f"Original text:\n{_LIGHTHOUSE}\n\nThe same text with the name Thomas Harlow changed to "
    + "Thomas Dale and nothing else changed:\n",
    f"Original text:\n{_MARKET}\n\nThe same text in the past tense:\n",
    f"Passage:\n{_LIGHTHOUSE}\n\nRepeat the passage word for word:\n",
    f"People:\n{_RECORDS}\n\nThe same people as a JSON list of objects with the keys name, "
    + 'age and city:\n[\n  {"name": "',
]

LOADS = {"chat": CHAT, "copy": COPY}
