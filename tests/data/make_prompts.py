"""Writes prompts.jsonl: a labelled prompt set over six domains for the expert router's
tests and its purity figure (``python tests/data/make_prompts.py``). Deterministic."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

DOMAINS: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "code": (
        [
            "Write a {lang} function that {task} and add unit tests for it.",
            "Why does my {lang} code raise {error} when I {task}?",
            "Refactor this {lang} class so that it {task} without global state.",
            "How do I {task} in {lang} using the standard library?",
            "Review my pull request: the {lang} module {task} but the tests fail with {error}.",
            "Explain the time complexity of an algorithm that {task}, with a {lang} example.",
            "My {lang} program {task} but the compiler reports {error}; how do I fix the build?",
        ],
        {
            "lang": ["Python", "Rust", "Go", "TypeScript", "Java", "C++", "Kotlin", "Haskell"],
            "task": [
                "parses a CSV file into records",
                "reverses a linked list in place",
                "debounces API calls",
                "merges two sorted arrays",
                "serialises a binary tree to JSON",
                "retries failed HTTP requests with backoff",
                "reads environment variables into a config struct",
                "implements an LRU cache",
            ],
            "error": [
                "a null pointer exception",
                "a type error",
                "an index out of range panic",
                "a segmentation fault",
                "a borrow checker error",
                "a stack overflow",
            ],
        },
    ),
    "math": (
        [
            "Solve the equation {a}x + {b} = {c} and show each step.",
            "Prove that the sum of the first {a} odd numbers is a perfect square.",
            "What is the derivative of {fn} with respect to x?",
            "Compute the integral of {fn} from 0 to {a}.",
            "Find the eigenvalues of the matrix [[{a}, {b}], [{b}, {c}]].",
            "A triangle has sides {a}, {b} and {c}; find its area and its largest angle.",
            "What is the probability of rolling a sum of {a} with two fair dice? Explain the "
            "counting.",
        ],
        {
            "a": [str(n) for n in (2, 3, 5, 7, 9, 11, 12)],
            "b": [str(n) for n in (4, 6, 8, 10, 13)],
            "c": [str(n) for n in (14, 15, 20, 21, 30)],
            "fn": ["x^2 sin(x)", "e^(3x) cos(x)", "ln(x^2 + 1)", "sqrt(1 - x^2)", "x^3 - 4x"],
        },
    ),
    "cooking": (
        [
            "Give me a recipe for {dish} that serves {n} people, with {ingredient}.",
            "How long should I roast {ingredient} in the oven at {n}0 degrees?",
            "What can I substitute for {ingredient} when baking {dish}?",
            "My {dish} always comes out dry; what am I doing wrong with the {ingredient}?",
            "Plan a vegetarian dinner menu around {dish} and a side of {ingredient}.",
            "How do I season and marinate {ingredient} for a {dish} on the grill?",
        ],
        {
            "dish": [
                "lasagna",
                "banana bread",
                "chicken curry",
                "risotto",
                "sourdough loaf",
                "paella",
                "chocolate cake",
                "ramen broth",
            ],
            "ingredient": [
                "butter",
                "eggs",
                "garlic",
                "saffron",
                "buttermilk",
                "sweet potatoes",
                "fresh basil",
                "tofu",
            ],
            "n": ["4", "6", "8", "18", "20"],
        },
    ),
    "health": (
        [
            "What are the common symptoms of {condition} and when should I see a doctor?",
            "Is it safe to take {drug} together with {drug2} for {condition}?",
            "How much {nutrient} does an adult need per day to prevent {condition}?",
            "My child has {symptom} and a fever; what could cause it?",
            "Explain how {drug} works in the body and its usual side effects.",
            "What exercises help with recovery from {condition} after surgery?",
        ],
        {
            "condition": [
                "migraine",
                "type 2 diabetes",
                "high blood pressure",
                "asthma",
                "anemia",
                "osteoporosis",
                "knee arthritis",
            ],
            "drug": ["ibuprofen", "metformin", "paracetamol", "amoxicillin", "lisinopril"],
            "drug2": ["aspirin", "antihistamines", "statins", "antacids"],
            "nutrient": ["vitamin D", "iron", "calcium", "fibre", "protein"],
            "symptom": ["a rash", "a persistent cough", "stomach pain", "an ear infection"],
        },
    ),
    "law": (
        [
            "Can my landlord {action} without notice under a {contract}?",
            "What are my rights if my employer {action2} in breach of my {contract}?",
            "How do I file a small claims case against a company that {action2}?",
            "Is a verbal {contract} legally binding if the other party {action2}?",
            "Explain the statute of limitations for {claim} claims in civil court.",
            "What should a {contract} include to protect me against {claim} liability?",
        ],
        {
            "action": [
                "raise the rent",
                "keep my security deposit",
                "enter the apartment",
                "evict my roommate",
                "terminate the lease",
            ],
            "action2": [
                "withholds my final paycheck",
                "breaks the agreement",
                "refuses a refund",
                "misclassifies me as a contractor",
                "changes the terms",
            ],
            "contract": [
                "residential lease",
                "employment contract",
                "non-disclosure agreement",
                "sales contract",
                "tenancy agreement",
            ],
            "claim": ["defamation", "negligence", "copyright", "wrongful termination", "fraud"],
        },
    ),
    "travel": (
        [
            "Plan a {n}-day itinerary for {city} in {season} on a budget.",
            "What is the best way to get from the airport to the centre of {city}?",
            "Do I need a visa to visit {country} for {n} days as a tourist?",
            "Which neighbourhoods in {city} are good for a family hotel stay in {season}?",
            "Recommend hiking trails and day trips near {city} for {season}.",
            "How much should I budget per day for food and trains when backpacking in {country}?",
        ],
        {
            "city": ["Lisbon", "Kyoto", "Mexico City", "Reykjavik", "Marrakesh", "Vancouver"],
            "country": ["Japan", "Peru", "Vietnam", "Morocco", "Norway", "New Zealand"],
            "season": ["winter", "spring", "late autumn", "the rainy season", "summer"],
            "n": ["3", "5", "7", "10", "14"],
        },
    ),
}


# Context people add around a question; it carries the domain's vocabulary across templates.
CONTEXT: dict[str, list[str]] = {
    "code": [
        "I am debugging a service in production.",
        "Our CI pipeline runs the test suite on every commit.",
        "The repository uses a monorepo with several packages.",
        "Performance matters because this runs in a hot loop.",
        "I am new to this programming language.",
        "",
    ],
    "math": [
        "This is for my calculus homework.",
        "I am studying for an algebra exam.",
        "Please keep the notation rigorous.",
        "Our textbook covers linear algebra and geometry.",
        "I want an intuitive explanation, not just the formula.",
        "",
    ],
    "cooking": [
        "I am cooking for a dinner party tonight.",
        "My kitchen only has a small oven and one pan.",
        "We follow a mostly vegetarian diet at home.",
        "The recipe is from my grandmother's cookbook.",
        "I am a beginner cook.",
        "",
    ],
    "health": [
        "I am asking for a family member who is worried.",
        "My doctor is on holiday this week.",
        "I have a history of allergies to some medicines.",
        "The symptoms started a few days ago.",
        "I want to understand the treatment options.",
        "",
    ],
    "law": [
        "I live in a rented flat and the dispute is getting worse.",
        "I cannot afford a lawyer right now.",
        "The court hearing is scheduled for next month.",
        "I signed the document last year without reading it carefully.",
        "My employer has a legal department that ignores me.",
        "",
    ],
    "travel": [
        "It will be my first trip abroad.",
        "I am travelling with two children and a lot of luggage.",
        "We prefer trains and public transport to renting a car.",
        "I want to avoid tourist traps and crowded places.",
        "Our flights are already booked.",
        "",
    ],
}


def generate(per_domain: int = 60, seed: int = 11) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    for label, (templates, slots) in DOMAINS.items():
        seen: set[str] = set()
        for template in itertools.cycle(templates):
            if len(seen) >= per_domain:
                break
            fills = {k: rng.choice(v) for k, v in slots.items()}
            before, after = rng.choice(CONTEXT[label]), rng.choice(CONTEXT[label])
            prompt = " ".join(p for p in (before, template.format(**fills), after) if p)
            if prompt not in seen:
                seen.add(prompt)
                rows.append({"prompt": prompt, "label": label})
    rng.shuffle(rows)
    return rows


if __name__ == "__main__":
    out = Path(__file__).with_name("prompts.jsonl")
    lines = [json.dumps(r) for r in generate()]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {out}")
