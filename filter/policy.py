"""What to do with each kind of finding: a pydantic model that travels as a plain dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Action = Literal["block", "redact", "flag", "off"]
Preset = Literal["default", "strict"]

# Keys are detector ids ("pii.card") or categories ("pii"); an id beats its category.
PRESETS: dict[str, dict[str, Action]] = {
    # The entropy detector is a heuristic: flag it rather than rewrite content on a guess.
    "default": {
        "secret": "redact",
        "secret.high_entropy": "flag",
        "pii": "flag",
        "pii.card": "redact",
        "injection": "flag",
        "blocklist": "flag",
    },
    # Stops a request or stream on secrets and card numbers; the entropy heuristic redacts
    # instead of blocking so long random-looking data cannot kill a stream by itself.
    "strict": {
        "secret": "block",
        "secret.high_entropy": "redact",
        "pii": "redact",
        "pii.card": "block",
        "injection": "block",
        "blocklist": "block",
        # A prompt given as token ids cannot be read (the filter has no tokenizer).
        "input.token_ids": "block",
    },
}

MAX_TERM_LENGTH = 64


class FilterPolicy(BaseModel):
    """Maps detector ids or categories to actions, on top of a preset.

    Lookup order for a detector ``pii.card``: ``actions["pii.card"]``, ``actions["pii"]``,
    the preset's entry for the id, then for the category, then ``default_action``.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    preset: Preset = "default"
    actions: dict[str, Action] = Field(default_factory=dict)
    default_action: Action = "flag"
    # Whole-word, case-insensitive terms reported by the ``blocklist`` detector.
    blocklist: tuple[str, ...] = ()
    # A text is flagged as an injection attempt once its phrase scores add up to this.
    injection_threshold: float = Field(default=1.0, gt=0)

    @field_validator("blocklist")
    @classmethod
    def _check_terms(cls, terms: tuple[str, ...]) -> tuple[str, ...]:
        # Bounded so a streamed term always fits in the scanner's hold-back window.
        for term in terms:
            if len(term) > MAX_TERM_LENGTH:
                raise ValueError(f"blocklist terms are at most {MAX_TERM_LENGTH} characters")
        return tuple(t for t in terms if t.strip())

    def action_for(self, detector_id: str) -> Action:
        """The action for one detector id."""
        category = detector_id.partition(".")[0]
        for table in (self.actions, PRESETS[self.preset]):
            action = table.get(detector_id) or table.get(category)
            if action is not None:
                return action
        return self.default_action

    def to_dict(self) -> dict[str, Any]:
        """Plain, msgpack-friendly form."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> FilterPolicy:
        """Build from a dict; unknown keys are ignored, ``None`` gives the default policy."""
        return cls.model_validate(dict(data or {}))

    @classmethod
    def strict(cls, **overrides: Any) -> FilterPolicy:
        """The strict preset: blocks secrets, card numbers, injections and blocklisted terms."""
        return cls.model_validate({**overrides, "preset": "strict"})
