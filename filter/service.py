"""The filter stage: scans a request's messages with the principal's policy.

Block → 400 ``content_blocked.<detector>`` (the sensitive text is never echoed); redact →
the messages go on with the matches replaced; flag → the detectors are noted in a header
and the log. The resolved policy travels in the envelope, so the worker scans the output
stream with the same engine.
"""

from __future__ import annotations

from typing import Any

from nats.aio.msg import Msg

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from bus_schemas.messages import CLAIM, check_envelope, is_token_ids
from filter.policy import FilterPolicy
from filter.scanner import Scanner
from services import bodies, tracing
from services.config import FilterSettings
from services.runtime import Service

OFF = "off"


class Policies:
    """Named policies: the built-in presets, ``off``, and those configured."""

    def __init__(self, cfg: FilterSettings) -> None:
        self.default = cfg.default_policy
        self._named: dict[str, FilterPolicy | None] = {
            "default": FilterPolicy(),
            "strict": FilterPolicy.strict(),
            OFF: None,
        }
        for name, fields in cfg.policies.items():
            self._named[name] = FilterPolicy.from_dict(fields)
        self._scanners: dict[str, Scanner] = {}

    def get(self, name: str | None) -> tuple[str, FilterPolicy | None]:
        key = name if name in self._named else self.default
        return key, self._named.get(key, FilterPolicy())

    def scanner(self, name: str, policy: FilterPolicy) -> Scanner:
        sc = self._scanners.get(name)
        if sc is None:
            sc = self._scanners[name] = Scanner(policy)
        return sc


# The policy entry for a completions prompt given as token ids (scan_envelope).
TOKEN_IDS = "input.token_ids"


def scan_envelope(env: dict[str, Any], scanner: Scanner) -> tuple[bool, list[str]]:
    """Scan (and redact in place) the envelope's text; returns (changed, flagged ids). A
    token id prompt cannot be read here (the filter has no tokenizer): the policy's action
    for ``input.token_ids`` says what happens to it, never silently: ``flag`` (the default
    preset's) passes it on unread and flagged, ``block`` or ``redact`` (the strict
    preset's: it cannot be redacted) refuse it, ``off`` passes it on."""
    changed = False
    flagged: list[str] = []
    if is_token_ids(env.get("prompt")):
        action = scanner.policy.action_for(TOKEN_IDS)
        if action in ("block", "redact"):
            raise E.InvalidRequest(
                f"prompt: this key's content filter policy reads prompts as text ({TOKEN_IDS}: "
                f"{action}), and a token id prompt cannot be read without the model's "
                "tokenizer; send the prompt as text",
                param="prompt",
            )
        if action == "flag":
            flagged.append(TOKEN_IDS)
    for holder, field in _texts(env):
        text = holder[field] if isinstance(holder, list) else holder.get(field)
        if not isinstance(text, str) or not text:
            continue
        res = scanner.scan(text)
        if res.blocked:
            raise E.ContentBlocked(
                f"the request was blocked by the content filter ({res.blocked}); remove "
                "that content and send it again",
                param=res.blocked,
            )
        if res.redacted:
            holder[field] = res.redacted_text
            changed = True
        flagged.extend(res.flagged)
    return changed, flagged


def _texts(env: dict[str, Any]) -> list[tuple[Any, Any]]:
    """Every text a client sent in the envelope, as (holder, key) so it can be redacted in
    place: message contents and their text and refusal parts (tool results are messages too),
    reasoning sent back in assistant turns, the arguments of tool calls in the history (a
    custom tool call's input), the tools' descriptions, the prompt, embedding inputs, and a
    migrated request's text so far. Images, audio and files are not text: they are not
    scanned."""
    out: list[tuple[Any, Any]] = []
    for m in env.get("messages") or ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    out.append((part, "refusal" if part.get("type") == "refusal" else "text"))
        else:
            out.append((m, "content"))
        # An assistant turn's reasoning, sent back by clients that keep it.
        out.extend((m, k) for k in ("reasoning_content", "reasoning") if k in m)
        calls = [c for c in _list(m.get("tool_calls")) if isinstance(c, dict)]
        fns = [c.get("function") for c in calls]
        fns.append(m.get("function_call"))  # the legacy single call
        out.extend((fn, "arguments") for fn in fns if isinstance(fn, dict))
        # A custom tool's call: its free-text input.
        out.extend((c["custom"], "input") for c in calls if isinstance(c.get("custom"), dict))
    for tool in _list((env.get("extra") or {}).get("tools")):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict):  # rendered into the prompt by chat templates
            out.append((fn, "description"))
    if env.get("prompt") is not None:
        out.append((env, "prompt"))
    inputs = env.get("input")
    if isinstance(inputs, list):
        out.extend((inputs, i) for i, item in enumerate(inputs) if isinstance(item, str))
    if isinstance(env.get("resume"), dict):  # a migrated request's text so far
        out.append((env["resume"], "text"))
    return out


def _list(value: Any) -> list[Any]:
    """``value`` if it is a list, else nothing (a client's field of the wrong type)."""
    return value if isinstance(value, list) else []


def filter_request(policies: Policies, hdrs: dict[str, str], env: dict[str, Any], log: Any) -> bool:
    """The filter stage's work on one request (headers and envelope changed in place);
    returns whether the envelope changed. Raises ContentBlocked."""
    name, policy = policies.get(hdrs.get(H.FILTER_POLICY))
    if policy is None:
        return False
    try:
        changed, flagged = scan_envelope(env, policies.scanner(name, policy))
    except E.ContentBlocked as exc:
        tracing.verdict(
            subjects.STAGE_FILTER,
            "block",
            {
                "tokenbus.policy": name,
                "tokenbus.detector": exc.detector,
                tracing.ERROR_TYPE: exc.code,
            },
        )
        raise
    if tracing.on():
        tracing.verdict(
            subjects.STAGE_FILTER,
            "redact" if changed else "flag" if flagged else "allow",
            {"tokenbus.policy": name, tracing.DETECTORS: sorted(set(flagged)) or None},
        )
    if changed and CLAIM in env:
        # Its messages travel as an object the filter may not rewrite: fail closed.
        raise E.ContentBlocked(
            "the content filter would redact this request, and a request this large "
            "(claim-checked, docs/large-requests.md) cannot be redacted; remove the "
            "flagged content",
            param="redact",
        )
    if flagged:
        hdrs[H.FILTER_FLAGS] = ",".join(sorted(set(flagged)))
        log.info(
            "content_flagged", request_id=hdrs.get(H.REQUEST_ID), detectors=sorted(set(flagged))
        )
    env["filter_policy"] = policy.to_dict()
    return True


class Filter(Service):
    """Scans input messages; hands the policy on for output scanning."""

    name = subjects.STAGE_FILTER

    async def setup(self) -> None:
        self.policies = Policies(self.settings.filter)
        await self.stage_endpoints(subjects.STAGE_FILTER).add("filter", self.handle)

    async def handle(self, msg: Msg) -> None:
        hdrs = dict(msg.headers or {})
        if self.policies.get(hdrs.get(H.FILTER_POLICY))[1] is None:
            await self.forward_next(msg, hdrs, msg.data)
            return
        env = codec.decode_map(msg.data)
        check_envelope(env)
        await bodies.resolve(self.nc, env)
        filter_request(self.policies, hdrs, env, self.log)
        await self.forward_next(msg, hdrs, bodies.encode(env))
