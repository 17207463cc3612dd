"""An offline multi-hop world in HotpotQA's schema: fictional entities, templated bridge and comparison questions.

HotpotQA and a Wikipedia index cannot be downloaded here, and a tiny model could not answer them anyway. This module
makes a small world of made-up people, cities, countries, companies and bands whose facts live in short paragraphs,
so that answering needs the same two searches a HotpotQA question needs: "In which city was the founder of Zorblax
Inc. born?" is answered by searching the company (to learn the founder) and then the founder (to learn the city).
Names are composed of syllables, so they are unknown to any pretrained model, short, and split into few tokens.

Examples follow HotpotQA's distractor layout as the ``datasets`` library stores it (``context`` and
``supporting_facts`` as dicts of lists), so everything downstream (corpus, retrievers, prompts) treats synthetic and
real data alike. ``scripted_search_conversation`` writes the ideal agent trajectory for warm-starting a model.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trl_tree.envs.hotpot import SEARCH_TOOL_NAME, build_prompt, format_passages

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr"]
_VOWELS = ["a", "e", "i", "o", "u"]
_CODAS = ["", "", "", "n", "r", "l", "x", "m", "s"]
_OCCUPATIONS = ["painter", "chemist", "pilot", "novelist", "architect", "sculptor", "violinist", "engineer"]
_INDUSTRIES = ["software", "shipping", "textile", "mining", "toy", "coffee", "glass", "robotics"]
_GENRES = ["rock", "jazz", "folk", "punk", "synth", "blues"]
_FEATURES = ["harbour", "bridges", "markets", "towers", "gardens", "canals"]
_COMPANY_SUFFIXES = ["Inc.", "Corp", "Labs", "Works"]
_LEVELS = ["easy", "medium", "hard"]
BRIDGE_FRACTION = 0.7


def _with_article(noun: str) -> str:
    """``noun`` preceded by "a" or "an", so the paragraphs read like the English the model will see elsewhere."""
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


@dataclass(frozen=True)
class Fact:
    """A paragraph (its title is the entity name) and the sentence that states the fact a question needs."""

    title: str
    sent_id: int


@dataclass(frozen=True)
class QuestionSpec:
    """A question before it is given distractors: the two supporting facts, in the order an agent finds them."""

    question: str
    answer: str
    type: str
    facts: tuple[Fact, Fact]


class World:
    """The fictional entities and their paragraphs (title -> sentences), drawn from one seeded RNG.

    Every word in every name is unique across the world, so a name retrieves its own paragraph and nothing else by
    accident; company suffixes ("Inc.") are the only shared name words.
    """

    def __init__(self, size: int, rng: random.Random):
        self._rng = rng
        self._used_words: set[str] = set()
        self.paragraphs: dict[str, list[str]] = {}
        self.kind: dict[str, str] = {}  # title -> entity kind, to pick distractors of the gold paragraphs' kinds
        self.countries = [self._word(rng.choice(["ia", "land", "stan"])) for _ in range(max(3, size // 6))]
        self.cities = [self._add_city() for _ in range(max(4, size // 2))]
        self.people = [self._add_person() for _ in range(2 * size)]
        founders, singers = self.people[:size], self.people[size:]
        self.companies = [self._add_company(founder) for founder in founders]
        self.bands = [self._add_band(singer) for singer in singers]

    # -- names -----------------------------------------------------------------------------------------------------

    def _word(self, suffix: str = "") -> str:
        """A fresh capitalised word of two or three syllables (plus ``suffix``), unique within the world."""
        while True:
            syllables = self._rng.choice([2, 2, 3])
            stem = "".join(
                self._rng.choice(_ONSETS) + self._rng.choice(_VOWELS) + self._rng.choice(_CODAS)
                for _ in range(syllables)
            )
            word = stem.capitalize() + suffix
            if word not in self._used_words and len(stem) <= 9:
                self._used_words.add(word)
                return word

    def _year(self, low: int, high: int) -> int:
        return self._rng.randint(low, high)

    # -- entities (each writes its paragraph; facts live at fixed sentence ids) -----------------------------------

    def _add(self, kind: str, title: str, sentences: list[str], **facts: Any) -> dict[str, Any]:
        self.paragraphs[title] = sentences
        self.kind[title] = kind
        return {"name": title, **facts}

    def _add_city(self) -> dict[str, Any]:
        name, country, year = self._word(), self._rng.choice(self.countries), self._year(900, 1800)
        sentences = [
            f"{name} is a city in {country}.",
            f"{name} was founded in {year}.",
            f"It is known for its {self._rng.choice(_FEATURES)}.",
        ]
        return self._add("city", name, sentences, country=country, founded=year)

    def _add_person(self) -> dict[str, Any]:
        name, city, year = f"{self._word()} {self._word()}", self._rng.choice(self.cities), self._year(1900, 1990)
        sentences = [
            f"{name} is {_with_article(self._rng.choice(_OCCUPATIONS))}.",
            f"{name} was born in {city['name']}.",
            f"{name} was born in {year}.",
        ]
        return self._add("person", name, sentences, birthplace=city["name"], born=year)

    def _add_company(self, founder: dict[str, Any]) -> dict[str, Any]:
        name = f"{self._word()} {self._rng.choice(_COMPANY_SUFFIXES)}"
        city, year = self._rng.choice(self.cities), self._year(1920, 2015)
        sentences = [
            f"{name} is {_with_article(self._rng.choice(_INDUSTRIES))} company founded by {founder['name']}.",
            f"{name} was founded in {year}.",
            f"Its headquarters are in {city['name']}.",
        ]
        return self._add("company", name, sentences, founder=founder, founded=year, headquarters=city)

    def _add_band(self, singer: dict[str, Any]) -> dict[str, Any]:
        name, city, year = self._word("s"), self._rng.choice(self.cities), self._year(1950, 2015)
        sentences = [
            f"{name} is a {self._rng.choice(_GENRES)} band from {city['name']}.",
            f"The lead singer of {name} is {singer['name']}.",
            f"{name} was formed in {year}.",
        ]
        return self._add("band", name, sentences, singer=singer, formed=year, hometown=city)


# ---------------------------------------------------------------------------------------------------------------
# Question templates. Fact sentence ids refer to the paragraph layouts above.
# ---------------------------------------------------------------------------------------------------------------


def _bridge_questions(world: World) -> list[QuestionSpec]:
    """Every two-hop question of the world: the first paragraph names the entity whose paragraph has the answer."""
    specs = []
    for company in world.companies:
        name, founder, hq = company["name"], company["founder"], company["headquarters"]
        specs.append(
            QuestionSpec(
                f"In which city was the founder of {name} born?",
                founder["birthplace"],
                "bridge",
                (Fact(name, 0), Fact(founder["name"], 1)),
            )
        )
        specs.append(
            QuestionSpec(
                f"In which country are the headquarters of {name}?",
                hq["country"],
                "bridge",
                (Fact(name, 2), Fact(hq["name"], 0)),
            )
        )
    for band in world.bands:
        name, singer = band["name"], band["singer"]
        specs.append(
            QuestionSpec(
                f"In which city was the lead singer of {name} born?",
                singer["birthplace"],
                "bridge",
                (Fact(name, 1), Fact(singer["name"], 1)),
            )
        )
        specs.append(
            QuestionSpec(
                f"In which year was the lead singer of {name} born?",
                str(singer["born"]),
                "bridge",
                (Fact(name, 1), Fact(singer["name"], 2)),
            )
        )
    return specs


def _earlier(first: dict, second: dict, key: str) -> str | None:
    """The name of the entity with the smaller ``key`` (a year), or None on a tie, which has no answer."""
    if first[key] == second[key]:
        return None
    return (first if first[key] < second[key] else second)["name"]


def _comparison_question(world: World, rng: random.Random) -> QuestionSpec | None:
    """One random comparison between two entities of a kind; None when the pair has no answer (equal years)."""
    kind = rng.choice(["company", "person", "band", "city"])
    if kind == "city":
        a, b = rng.sample(world.cities, 2)
        answer = "yes" if a["country"] == b["country"] else "no"
        return QuestionSpec(
            f"Are {a['name']} and {b['name']} in the same country?",
            answer,
            "comparison",
            (Fact(a["name"], 0), Fact(b["name"], 0)),
        )
    pool, key, sent_id, template = {
        "company": (world.companies, "founded", 1, "Which company was founded first, {} or {}?"),
        "person": (world.people, "born", 2, "Who was born first, {} or {}?"),
        "band": (world.bands, "formed", 2, "Which band was formed first, {} or {}?"),
    }[kind]
    a, b = rng.sample(pool, 2)
    answer = _earlier(a, b, key)
    if answer is None:
        return None
    return QuestionSpec(
        template.format(a["name"], b["name"]),
        answer,
        "comparison",
        (Fact(a["name"], sent_id), Fact(b["name"], sent_id)),
    )


def _sample_specs(world: World, num_questions: int, rng: random.Random) -> list[QuestionSpec]:
    """``num_questions`` distinct questions, about ``BRIDGE_FRACTION`` of them bridge questions."""
    bridge = _bridge_questions(world)
    rng.shuffle(bridge)
    num_bridge = min(len(bridge), round(BRIDGE_FRACTION * num_questions))
    specs, seen = bridge[:num_bridge], {spec.question for spec in bridge[:num_bridge]}
    for _ in range(100 * num_questions):
        if len(specs) == num_questions:
            break
        spec = _comparison_question(world, rng)
        if spec is not None and spec.question not in seen:
            specs.append(spec)
            seen.add(spec.question)
    if len(specs) < num_questions:
        raise RuntimeError(f"Could only make {len(specs)} distinct questions out of {num_questions} requested.")
    rng.shuffle(specs)
    return specs


def _distractors(world: World, gold_titles: list[str], count: int, rng: random.Random) -> list[str]:
    """Distractor titles, half of the gold paragraphs' kinds (as HotpotQA picks look-alikes), half at random."""
    gold_kinds = {world.kind[title] for title in gold_titles}
    others = [title for title in world.paragraphs if title not in gold_titles]
    similar = [title for title in others if world.kind[title] in gold_kinds]
    chosen = rng.sample(similar, min(len(similar), count // 2))
    rest = [title for title in others if title not in chosen]
    return chosen + rng.sample(rest, count - len(chosen))


def _to_example(world: World, spec: QuestionSpec, index: int, seed: int, num_distractors: int, rng: random.Random):
    """A HotpotQA distractor-setting record (dict-of-lists layout) for one question."""
    gold_titles = [fact.title for fact in spec.facts]
    titles = gold_titles + _distractors(world, gold_titles, num_distractors, rng)
    rng.shuffle(titles)
    return {
        "id": f"synthetic-{seed}-{index:06d}",
        "question": spec.question,
        "answer": spec.answer,
        "type": spec.type,
        "level": rng.choice(_LEVELS),
        "supporting_facts": {
            "title": [fact.title for fact in spec.facts],
            "sent_id": [fact.sent_id for fact in spec.facts],
        },
        "context": {"title": titles, "sentences": [list(world.paragraphs[title]) for title in titles]},
    }


def make_synthetic_hotpot(num_questions: int, seed: int = 0, num_distractors: int = 6) -> list[dict[str, Any]]:
    """``num_questions`` distinct synthetic HotpotQA questions (2 gold + ``num_distractors`` paragraphs each).

    Deterministic in ``seed``. The world grows with ``num_questions`` so that there are enough distinct questions;
    a fixed seed and count always give the same world and the same questions.
    """
    if num_questions < 1:
        raise ValueError(f"num_questions must be positive, got {num_questions}.")
    rng = random.Random(seed)
    world = World(size=max(8, num_questions // 3 + 4), rng=rng)
    specs = _sample_specs(world, num_questions, rng)
    return [_to_example(world, spec, i, seed, num_distractors, rng) for i, spec in enumerate(specs)]


def synthetic_splits(
    num_train: int, num_test: int, seed: int = 0, num_distractors: int = 6
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and test questions over one shared world.

    Test questions are new questions, not new facts: their paragraphs belong to the same world as training's (and
    appear in training contexts as distractors or golds), so a held-out score measures the learned search-and-read
    behaviour rather than memorised answers.
    """
    examples = make_synthetic_hotpot(num_train + num_test, seed=seed, num_distractors=num_distractors)
    return examples[:num_train], examples[num_train:]


# ---------------------------------------------------------------------------------------------------------------
# Scripted agent trajectories (warm-start data)
# ---------------------------------------------------------------------------------------------------------------


def _paragraphs(example: dict[str, Any]) -> list[dict[str, str]]:
    """The example's context as passages, in context order."""
    context = example["context"]
    return [
        {"title": title, "text": " ".join(sentences)}
        for title, sentences in zip(context["title"], context["sentences"])
    ]


def _oracle_search(example: dict[str, Any], topk: int) -> Callable[[str], str]:
    """A search over the example's own context that returns the paragraph titled by the query first.

    The warm-start data should show the agent reading the right passage, without a retriever in the loop.
    """
    passages = _paragraphs(example)

    def search(query: str) -> str:
        ranked = sorted(passages, key=lambda passage: passage["title"] != query)
        return format_passages(ranked[:topk])

    return search


def _tool_call_message(content: str, query: str) -> dict[str, Any]:
    """An assistant turn that calls the search tool once."""
    call = {"type": "function", "function": {"name": SEARCH_TOOL_NAME, "arguments": {"query": query}}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def scripted_search_conversation(
    example: dict[str, Any],
    search: Callable[[str], str] | None = None,
    topk: int = 3,
    include_prompt: bool = True,
) -> list[dict[str, Any]]:
    """The ideal agent trajectory for a synthetic question: one search per hop, then ``<answer>...</answer>``.

    The queries are the supporting paragraphs' titles in order (the entity the question names, then the bridge
    entity the first passage revealed, or the second compared entity). ``search`` produces the observations; by
    default an oracle over the example's own context. With ``include_prompt`` the conversation starts with
    :func:`build_prompt`'s system and user messages, ready for SFT.
    """
    search = search or _oracle_search(example, topk)
    first, second = example["supporting_facts"]["title"][:2]
    messages = build_prompt(example["question"]) if include_prompt else []
    messages += [
        _tool_call_message(f"I should search for {first} first.", first),
        {"role": "tool", "name": SEARCH_TOOL_NAME, "content": search(first)},
        _tool_call_message(f"Now I should search for {second} as well.", second),
        {"role": "tool", "name": SEARCH_TOOL_NAME, "content": search(second)},
        {"role": "assistant", "content": f"<answer> {example['answer']} </answer>"},
    ]
    return messages
