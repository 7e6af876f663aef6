"""The detectors: one precompiled regex each, plus a validator where a regex cannot decide.

Every detector has a stable dotted id (``pii.email``, ``secret.aws_access_key``, ...) whose
first part is its category (``pii``, ``secret``, ``blocklist``, ``injection``). Ids appear in
policies, in findings and in error codes, so they never change meaning.

Each regex is bounded: ``reach`` is the furthest a match (plus its lookahead) can extend from
where it starts. :class:`filter.scanner.StreamScanner` relies on this to know how much of a
stream it must hold back. Token secrets and private-key blocks can be longer than that; for
them the regex matches a bounded *head* and ``terminator`` says where the full secret ends,
which is used when the secret is redacted (so its tail is never left behind).

Tradeoffs, chosen for few false positives on ordinary prose and code:

* Phone numbers need a ``+country`` prefix or separators in a national shape (``555-123-4567``,
  ``(555) 123-4567``, ``020 7946 0958``); bare digit runs, dates, times, versions, IP addresses
  and numbers glued to ``#``, ``-``, ``/``, ``:``, ``=`` or ``.`` (order numbers, ids) are not
  phones.
* Card numbers start with 2-6 (the major networks), have 13-19 digits (contiguous, or in the
  usual 4-4-4-4 / 4-6-5 groups) and must pass Luhn.
* SSNs need separators (``AAA-GG-SSSS``); plain nine-digit numbers are too common to flag.
* The entropy detector ignores hex-only tokens (git SHAs, UUIDs, digests, hex colours): they
  are rarely secrets in chat traffic and very common in code and logs. Hex secrets without a
  known prefix are therefore missed. It also ignores tokens without a digit and tokens made of
  words (identifiers such as ``HAVE_GCC_ASM_FOR_X64`` or ``AllowS3ListAllMyBuckets``). On the
  standard library's 41k long identifiers it reports none; it misses about 15% of random
  20-character tokens, 5% at 32 and under 1% from 48 characters.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# A check gets the regex match and returns where the finding ends, or -1 to reject it.
Check = Callable[[re.Match[str]], int]


@dataclass(frozen=True, slots=True)
class Gate:
    """A cheap regex that every match of some detectors contains near its start.

    A match starting at ``s`` contains a gate hit at or after ``s`` and at most ``offset``
    characters into it, so a scanner may skip to ``first hit - offset`` (or skip the
    detectors entirely when there is no hit). Detectors share gates so one search decides
    for a whole family.
    """

    pattern: re.Pattern[str]
    offset: int
    # Hits are rare (a few per text): search for matches hit by hit in a bounded window
    # rather than letting the detector's regex scan the rest of the text.
    sparse: bool = False


@dataclass(frozen=True, slots=True)
class Detector:
    """One detector: a bounded regex plus what the scanner needs to run it incrementally."""

    id: str
    pattern: re.Pattern[str]
    reach: int
    description: str
    check: Check | None = None
    gate: Gate | None = None
    # Run on an ASCII-lower-cased copy of the text (case-insensitive without re.IGNORECASE,
    # which defeats the regex engine's fast first-character scan).
    lower: bool = False
    # Matches wherever ``pattern`` can start: searched first, then ``pattern`` is tried there.
    # Big alternations (phrases) are slow to try at every word; their first words are not.
    anchor: re.Pattern[str] | None = None
    # Where a redacted secret really ends: the first match of this after the head.
    terminator: re.Pattern[str] | None = None
    terminator_inclusive: bool = False
    # How far back a resumed terminator search must start (a footer split across chunks).
    terminator_overlap: int = 0
    # A regex for a suffix of a stream that could still grow into a match of this detector
    # (anchored at the end by the scanner); ``None``: any word or spaced number in progress.
    # Streams that only need to hold for text-changing detectors use it (see
    # ``StreamScanner(changes_only=True)``), so ordinary words are released at once.
    stream_tail: str | None = None

    @property
    def category(self) -> str:
        return self.id.partition(".")[0]


def literal_tail(literals: Iterable[str], *, before: str | None, then: str = r"\S*") -> str:
    """A stream tail for matches that begin with one of ``literals``: a proper prefix of one,
    or the whole literal followed by ``then``. ``before`` is the character class that may not
    precede the match (as in the detector's own lookbehind), ``None`` for any."""
    lits = set(literals)
    prefixes = {lit[:k] for lit in lits for k in range(1, len(lit))} - lits
    alts = [re.escape(lit) + then for lit in sorted(lits, key=lambda w: (-len(w), w))]
    alts += [re.escape(p) for p in sorted(prefixes, key=lambda w: (-len(w), w))]
    guard = "" if before is None else f"(?<!{before})"
    return rf"{guard}(?:{'|'.join(alts)})"


# --- validators -----------------------------------------------------------------------------

_NON_DIGITS = re.compile(r"\D+")
# Luhn doubles every second digit from the right; this maps a digit to its doubled digit sum.
_DOUBLE = str.maketrans("0123456789", "0246813579")


def luhn_ok(number: str) -> bool:
    """The Luhn checksum of a digit string (separators ignored)."""
    digits = _NON_DIGITS.sub("", number)
    if not digits:
        return False
    total = sum(map(int, digits[-1::-2] + digits[-2::-2].translate(_DOUBLE)))
    return total % 10 == 0


_IBAN_LETTERS = {ord(c): str(10 + i) for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZ")}


def iban_ok(iban: str) -> bool:
    """The ISO 13616 mod-97 check of an IBAN (spaces ignored, registry length enforced)."""
    compact = iban.replace(" ", "").upper()
    if IBAN_LENGTHS.get(compact[:2]) != len(compact) or not compact.isalnum():
        return False
    rearranged = (compact[4:] + compact[:4]).translate(_IBAN_LETTERS)
    return rearranged.isdigit() and int(rearranged) % 97 == 1


# IBAN length per country (SWIFT IBAN registry).
IBAN_LENGTHS: dict[str, int] = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22,
    "BH": 22, "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22,
    "DK": 18, "DO": 28, "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FO": 18, "FR": 27,
    "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28,
    "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20,
    "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "LY": 25, "MC": 27,
    "MD": 24, "ME": 22, "MK": 19, "MR": 27, "MT": 31, "MU": 30, "NL": 18, "NO": 15,
    "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "SA": 24,
    "SC": 31, "SD": 18, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "ST": 25, "SV": 28,
    "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
}  # fmt: skip

# The rest of an IBAN after its first four characters, for each registry length.
_IBAN_BODY = {n: re.compile(rf"(?: ?[A-Z0-9]){{{n - 4}}}") for n in set(IBAN_LENGTHS.values())}


def _check_iban(m: re.Match[str]) -> int:
    # The regex is greedy (it may run into a following upper-case word); cut it to the
    # country's registry length, then require a boundary and the mod-97 check.
    text, start = m.string, m.start()
    length = IBAN_LENGTHS.get(text[start : start + 2])
    if length is None:
        return -1
    body = _IBAN_BODY[length].match(text, start + 4, m.end())
    if body is None:
        return -1
    end = body.end()
    if end < len(text) and text[end].isalnum():
        return -1
    return end if iban_ok(text[start:end]) else -1


def _check_card(m: re.Match[str]) -> int:
    # A grouped number may have swallowed a short trailing group (an expiry "12/25" or a
    # CVC); retry without it before giving up.
    text = m.group()
    if luhn_ok(text):
        return m.end()
    cut = max(text.rfind(" "), text.rfind("-"))
    if cut > 0 and len(_NON_DIGITS.sub("", text[:cut])) >= 16 and luhn_ok(text[:cut]):
        return m.start() + cut
    return -1


def _check_phone(m: re.Match[str]) -> int:
    text = m.group()
    n = len(_NON_DIGITS.sub("", text))
    if text.startswith("+"):
        return m.end() if 8 <= n <= 15 else -1
    return m.end() if 10 <= n <= 11 else -1


_RUNS = re.compile(r"[a-z]+|[A-Z]+|[0-9]+")
_WORDISH = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_VOWEL = re.compile(r"[aeiouyAEIOUY]")
_DIGIT = re.compile(r"[0-9]")
_HEXISH = re.compile(r"[0-9a-fA-F_\-]+")
_PARTS = re.compile(r"[^_\-/+=]+")


def looks_random(token: str) -> bool:
    """Whether a long token looks like random key material rather than words or a hash.

    Random base64/base62 text switches character class (lower, upper, digit) often, has few
    long same-class runs, few pronounceable segments and high Shannon entropy; identifiers
    built from words fail at least one of these.
    """
    if _DIGIT.search(token) is None or _HEXISH.fullmatch(token):
        return False
    runs = _RUNS.findall(token)
    alnum = sum(map(len, runs))
    if alnum < 16 or len(runs) < 0.35 * alnum:
        return False
    if sum(len(r) for r in runs if len(r) >= 4) > 0.45 * alnum:
        return False
    words = sum(
        len(s)
        for s in _WORDISH.findall(token)
        if len(s) >= 3 and not s.isdigit() and _VOWEL.search(s)
    )
    if words >= 0.6 * alnum:
        return False
    parts = _PARTS.findall(token)
    if len(parts) >= 3 and alnum < 7 * len(parts):  # dashed/underscored short words
        return False
    n = len(token)
    entropy = -sum(c / n * math.log2(c / n) for c in Counter(token).values())
    return entropy >= min(3.8, 0.8 * math.log2(n))


def _check_random_body(prefix_re: re.Pattern[str]) -> Check:
    def check(m: re.Match[str]) -> int:
        head = prefix_re.match(m.string, m.start())
        body = m.string[head.end() if head else m.start() : m.end()]
        return m.end() if looks_random(body) else -1

    return check


def _check_high_entropy(m: re.Match[str]) -> int:
    return m.end() if looks_random(m.group()) else -1


def _check_has_digit(m: re.Match[str]) -> int:
    return m.end() if _DIGIT.search(m.group(), 5) else -1


# --- the built-in detectors -----------------------------------------------------------------
#
# Patterns start with a literal or a character class, with the "not glued to the previous
# character" lookbehind placed after it: a leading lookbehind would make the regex engine try
# every position instead of skipping ahead in C to the possible first characters.

_TOKEN_END = re.compile(r"[^A-Za-z0-9_\-]")
_B64_END = re.compile(r"[^A-Za-z0-9+/=_\-]")
_PEM_FOOTER = re.compile(r"-----END (?:[A-Z0-9]{1,10} ){0,3}PRIVATE KEY(?: BLOCK)?-----")

SECRET_GATE = Gate(
    re.compile(
        r"-----BEGIN|A(?:KIA|SIA|BIA|CCA|Iza)|gh[pousr]_|github_pat_|sk-|k_(?:live|test)_|xox"
        r"|hooks\.slack\.com|tb-"
    ),
    offset=8,  # "https://" before hooks.slack.com; every other needle starts its match
    sparse=True,
)
DIGIT_GATE = Gate(re.compile(r"[0-9]"), offset=3)  # "AB 12..." (NINO), "GB82" (IBAN), "+1"
AT_GATE = Gate(re.compile(r"@"), offset=64, sparse=True)  # local part: at most 64 characters
RUN_GATE = Gate(re.compile(r"[A-Za-z0-9+/_\-]{20}"), offset=0)

_EMAIL = re.compile(
    r"[A-Za-z0-9](?<![\w.%+\-].)"
    r"(?<!g(?=it@))"  # ssh remotes (git@github.com:org/repo) name servers, not people
    # Bounds the whole match; possessive, so a long run fails at once instead of backtracking.
    r"(?<=(?=[A-Za-z0-9._%+\-@]{6,100}+(?![A-Za-z0-9._%+\-@])).)"
    r"(?:[A-Za-z0-9._%+\-]{0,62}[A-Za-z0-9_%+\-])?"
    r"@(?:[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?\.)+"
    # Retina assets (icon@2x.png) and similar file names are not addresses.
    r"(?!(?:png|jpe?g|gif|svg|webp|ico|bmp|tiff?|css|js|mjs|ts|tsx|jsx|map|json|ya?ml|toml"
    r"|lock|txt|md|html?|xml|pdf|zip|gz|py|rb|rs|java)(?![A-Za-z]))"
    r"[A-Za-z]{2,24}"
    r"(?![A-Za-z0-9\-_(]|\.[A-Za-z0-9])"  # "a@b.transpose()" is code
)

_PHONE = re.compile(
    r"[+(0-9](?<![\w+.\-/#:=@$].)"
    r"(?:(?<=\+)[1-9]\d{0,2}(?:[ .\-]?(?:\(\d{1,4}\)|\d{1,5})){2,6}"  # +44 20 7946 0958
    r"|(?<=\()\d{3}\) ?\d{3}[ .\-]\d{4}"  # (555) 123-4567
    r"|(?<=1)[ .\-]\(\d{3}\) ?\d{3}[ .\-]\d{4}"  # 1 (555) 123-4567
    r"|(?<=1)[.\-]\d{3}(?P<p1>[.\-])\d{3}(?P=p1)\d{4}"  # 1-555-123-4567
    r"|(?<=[0-9])\d{2}(?P<p2>[.\-])\d{3}(?P=p2)\d{4}"  # 555-123-4567, 555.123.4567
    r"|(?<=0)\d{1,4}[ \-]\d{3,4}[ \-]?\d{3,4})"  # 020 7946 0958, 07700 900123
    r"(?![\w]|[.\-/:]\d)"
)

_CARD = re.compile(
    r"[2-6](?<![\w.\-].)"
    r"(?:\d{12,18}"
    r"|\d{3}(?P<c1>[ \-])\d{4}(?P=c1)\d{4}(?P=c1)\d{1,4}(?:(?P=c1)\d{1,3})?"
    r"|(?<=3)\d{3}(?P<c2>[ \-])\d{6}(?P=c2)\d{4,5})"  # American Express 4-6-5
    r"(?![\w]|[.\-]\d)"
)

_SSN = re.compile(
    r"[0-8](?<![\w.\-].)\d\d(?<!000)(?<!666)"
    r"(?P<s>[\- ])(?!00)\d{2}(?P=s)(?!0000)\d{4}"
    r"(?![\w]|[.\-]\d)"
)

# UK National Insurance number: prefix letters exclude D F I Q U V (and O second); some
# prefixes are never allocated.
_NINO = re.compile(
    r"[ABCEGHJ-PRSTW-Z](?<!\w.)[ABCEGHJ-NPRSTW-Z](?<!BG|GB|KN|NK|NT|TN|ZZ)"
    r" ?\d{2} ?\d{2} ?\d{2} ?[A-D](?!\w)"
)

_IBAN = re.compile(r"[A-Z](?<![A-Za-z0-9].)[A-Z]\d{2}(?: ?[A-Z0-9]){11,30}")

_OPENAI_PREFIX = re.compile(r"sk-(?:(?:proj|svcacct|admin)-|ant-(?:api|admin)\d\d-)?")
_TB_PREFIX = re.compile(r"tb-")

BUILTIN: tuple[Detector, ...] = (
    Detector(
        "secret.private_key",
        re.compile(r"-----BEGIN (?:[A-Z0-9]{1,10} ){0,3}PRIVATE KEY(?: BLOCK)?-----"),
        reach=70,
        description="PEM private key block (redaction covers it up to its END line)",
        gate=SECRET_GATE,
        terminator=_PEM_FOOTER,
        terminator_inclusive=True,
        terminator_overlap=72,
        stream_tail=literal_tail(["-----BEGIN "], before=None, then=r"[^\n]*"),
    ),
    Detector(
        "secret.aws_access_key",
        re.compile(r"A(?:KIA|SIA|BIA|CCA)(?<![A-Za-z0-9].{4})[A-Z0-9]{16}(?![A-Za-z0-9])"),
        reach=21,
        description="AWS access key id",
        gate=SECRET_GATE,
        stream_tail=r"(?<![A-Za-z0-9])A[A-Z0-9]{0,19}",
    ),
    Detector(
        "secret.github_token",
        re.compile(
            r"g(?<![A-Za-z0-9_]g)(?:h[pousr]_[A-Za-z0-9]{36}|ithub_pat_[A-Za-z0-9_]{50,100})"
        ),
        reach=112,
        description="GitHub token (ghp_, gho_, ghu_, ghs_, ghr_, github_pat_)",
        gate=SECRET_GATE,
        stream_tail=literal_tail(
            [f"gh{c}_" for c in "pousr"] + ["github_pat_"], before="[A-Za-z0-9_]"
        ),
        terminator=_TOKEN_END,
    ),
    Detector(
        "secret.openai_key",
        re.compile(
            r"s(?<![A-Za-z0-9_\-]s)k-(?:(?:proj|svcacct|admin)-|ant-(?:api|admin)\d\d-)?"
            r"[A-Za-z0-9_\-]{20,100}"
        ),
        reach=115,
        description="OpenAI-style secret key (sk-, sk-proj-, sk-ant-...)",
        check=_check_random_body(_OPENAI_PREFIX),
        gate=SECRET_GATE,
        stream_tail=literal_tail(["sk-"], before=r"[A-Za-z0-9_\-]"),
        terminator=_TOKEN_END,
    ),
    Detector(
        "secret.stripe_key",
        re.compile(r"[sr](?<![A-Za-z0-9_\-].)k_(?:live|test)_[A-Za-z0-9]{20,100}"),
        reach=110,
        description="Stripe secret or restricted key",
        gate=SECRET_GATE,
        stream_tail=literal_tail(
            [f"{a}k_{b}_" for a in "sr" for b in ("live", "test")], before=r"[A-Za-z0-9_\-]"
        ),
        terminator=_TOKEN_END,
    ),
    Detector(
        "secret.slack_token",
        re.compile(r"x(?<![A-Za-z0-9\-]x)ox[abposr]-[A-Za-z0-9\-]{10,100}"),
        reach=106,
        description="Slack token (xoxb-, xoxp-, ...)",
        check=_check_has_digit,
        gate=SECRET_GATE,
        stream_tail=literal_tail([f"xox{c}-" for c in "abposr"], before=r"[A-Za-z0-9\-]"),
        terminator=_TOKEN_END,
    ),
    Detector(
        "secret.slack_webhook",
        re.compile(r"https://hooks\.slack\.com/services/[A-Za-z0-9_/]{20,80}"),
        reach=114,
        description="Slack incoming-webhook URL",
        gate=SECRET_GATE,
        stream_tail=literal_tail(["https://hooks.slack.com/services/"], before=None),
        terminator=re.compile(r"[^A-Za-z0-9_/]"),
    ),
    Detector(
        "secret.google_api_key",
        re.compile(r"A(?<![A-Za-z0-9_\-]A)Iza[0-9A-Za-z_\-]{35}(?![A-Za-z0-9_\-])"),
        reach=40,
        description="Google API key",
        gate=SECRET_GATE,
        stream_tail=literal_tail(["AIza"], before=r"[A-Za-z0-9_\-]"),
    ),
    Detector(
        "secret.tokenbus_key",
        re.compile(r"t(?<![A-Za-z0-9_\-]t)b-[A-Za-z0-9_\-]{20,100}"),
        reach=104,
        description="tokenbus API key (tb- followed by random url-safe characters)",
        check=_check_random_body(_TB_PREFIX),
        gate=SECRET_GATE,
        stream_tail=literal_tail(["tb-"], before=r"[A-Za-z0-9_\-]"),
        terminator=_TOKEN_END,
    ),
    Detector(
        "pii.iban",
        _IBAN,
        reach=66,
        description="IBAN (registry length and mod-97 checked)",
        check=_check_iban,
        gate=DIGIT_GATE,
    ),
    Detector(
        "pii.card",
        _CARD,
        reach=26,
        description="payment card number (13-19 digits, Luhn-checked)",
        check=_check_card,
        gate=DIGIT_GATE,
        stream_tail=r"[0-9][0-9 \-]*",
    ),
    Detector(
        "pii.ssn",
        _SSN,
        reach=14,
        description="US social security number (AAA-GG-SSSS, invalid ranges excluded)",
        gate=DIGIT_GATE,
    ),
    Detector(
        "pii.uk_nino",
        _NINO,
        reach=15,
        description="UK National Insurance number",
        gate=DIGIT_GATE,
    ),
    Detector("pii.email", _EMAIL, reach=103, description="e-mail address", gate=AT_GATE),
    Detector(
        "pii.phone",
        _PHONE,
        reach=48,
        description="phone number (+country code, or national format with separators)",
        check=_check_phone,
        gate=DIGIT_GATE,
    ),
    Detector(
        "secret.high_entropy",
        re.compile(r"[A-Za-z0-9+/_\-](?<![A-Za-z0-9+/=_\-].)[A-Za-z0-9+/_\-]{19,99}"),
        reach=101,
        description="long random-looking token (base64/base62 key material)",
        check=_check_high_entropy,
        gate=RUN_GATE,
        terminator=_B64_END,
    ),
)

# --- phrase detectors: blocklist and prompt injection --------------------------------------

# Words of an injection phrase may be separated by up to three non-word characters
# ("ignore, all previous instructions"); bounded so a phrase's reach is bounded.
PHRASE_SEP = r"\W{1,3}"
_BLOCK_SEP = r"\s{1,3}"


@dataclass(frozen=True, slots=True)
class Slot:
    """One position in a phrase: alternative words or word groups, possibly optional."""

    words: tuple[str, ...]
    optional: bool = False


def _slot(*words: str, opt: bool = False) -> Slot:
    # Accept typographic apostrophes too (U+2019, as in "you\u2019re").
    alts = {w for word in words for w in (word, word.replace("'", "\u2019"))}
    return Slot(tuple(sorted(alts, key=lambda w: (-len(w), w))), opt)


@dataclass(frozen=True, slots=True)
class InjectionRule:
    """A scored prompt-injection phrase; its id is ``injection.<name>``."""

    name: str
    weight: float
    slots: tuple[Slot, ...]

    @property
    def id(self) -> str:
        return f"injection.{self.name}"


def _alt(words: Iterable[str], sep: str) -> str:
    return "|".join(sep.join(re.escape(p) for p in w.split(" ")) for w in words)


def phrase_regex(slots: Sequence[Slot], sep: str = PHRASE_SEP) -> str:
    """The regex (without boundaries) matching a sequence of slots."""
    out = []
    for i, slot in enumerate(slots):
        alt = f"(?:{_alt(slot.words, sep)})"
        last = i == len(slots) - 1
        if slot.optional:
            if last:
                raise ValueError("a phrase cannot end in an optional slot")
            out.append(f"(?:{alt}{sep})?")
        else:
            out.append(alt if last else alt + sep)
    return "".join(out)


def phrase_reach(slots: Sequence[Slot], sep_max: int = 3) -> int:
    """The longest text a phrase can match, plus one character of lookahead."""
    total = 0
    for slot in slots:
        total += max(len(w) + w.count(" ") * (sep_max - 1) for w in slot.words) + sep_max
    return total + 1


_IGNORE = ("ignore", "disregard", "forget", "override", "bypass", "skip", "discard", "drop")
_QUANT = ("all", "any", "every", "each")
_DET = ("the", "your", "my", "these", "those", "this", "that", "its", "our")
_PRIOR = (
    "previous", "prior", "above", "earlier", "preceding", "foregoing", "former", "initial",
    "original", "old", "existing", "system", "developer", "safety", "default", "given",
)  # fmt: skip
_RULES = (
    "instructions", "instruction", "rules", "rule", "prompts", "prompt", "directions",
    "directives", "directive", "guidelines", "guidance", "constraints", "restrictions",
    "commands", "programming", "messages", "message", "context", "policies", "policy",
)  # fmt: skip
_PERSONA = (
    "dan", "jailbroken", "unrestricted", "unfiltered", "uncensored", "unchained", "unbound",
    "unlimited", "evil", "developer mode", "dev mode", "god mode", "jailbreak mode",
    "free from", "freed from",
)  # fmt: skip
_YOU_ARE = ("you are", "you're")

# fmt: off
INJECTION_RULES: tuple[InjectionRule, ...] = (
    InjectionRule(
        "ignore_instructions",
        1.0,
        (
            _slot(*_IGNORE),
            _slot(*_QUANT, opt=True),
            _slot("of", opt=True),
            _slot(*_DET, opt=True),
            _slot(*_PRIOR),
            _slot(*_RULES),
        ),
    ),
    InjectionRule(
        "reveal_prompt",
        1.0,
        (
            _slot(
                "reveal",
                "show",
                "print",
                "display",
                "output",
                "repeat",
                "tell",
                "give",
                "leak",
                "dump",
                "expose",
                "share",
                "recite",
                "write out",
                "spell out",
                "what is",
                "what's",
                "what are",
            ),
            _slot("me", "us", opt=True),
            _slot("the", "your", "its", opt=True),
            _slot("full", "entire", "complete", "exact", "verbatim", "raw", opt=True),
            _slot("system", "developer", "hidden", "secret", "internal", "initial"),
            _slot("prompt", "prompts", "instructions", "message"),
        ),
    ),
    InjectionRule(
        "persona",
        1.0,
        (
            _slot(*_YOU_ARE),
            _slot("now"),
            _slot("a", "an", "in", "the", opt=True),
            _slot(*_PERSONA),
        ),
    ),
    InjectionRule(
        "act_as",
        0.8,
        (
            _slot(
                "act",
                "behave",
                "respond",
                "roleplay",
                "role-play",
                "pretend to be",
                "pretend you are",
                "pretend you're",
                "pretend that you are",
            ),
            _slot("as", "like", opt=True),
            _slot("a", "an", opt=True),
            _slot(
                "dan",
                "jailbroken",
                "unrestricted",
                "unfiltered",
                "uncensored",
                "evil",
                "unethical",
                "amoral",
            ),
        ),
    ),
    InjectionRule(
        "not_bound",
        0.8,
        (
            _slot(*_YOU_ARE),
            _slot("no longer", "not"),
            _slot("bound", "restricted", "limited", "constrained", "governed"),
        ),
    ),
    InjectionRule(
        "disable_safety",
        0.7,
        (
            _slot(
                "bypass",
                "disable",
                "turn off",
                "deactivate",
                "circumvent",
                "evade",
                "get around",
                "remove",
            ),
            _slot("your", "the", "all", "any", opt=True),
            _slot("safety", "content", "ethical", "moral", opt=True),
            _slot(
                "filters",
                "filter",
                "guardrails",
                "safeguards",
                "censorship",
                "alignment",
                "protections",
            ),
        ),
    ),
    InjectionRule(
        "jailbreak_mode",
        0.6,
        (
            _slot("god", "jailbreak", "dan", "unrestricted", "evil", "chaos", "opposite"),
            _slot("mode"),
        ),
    ),
    InjectionRule(
        "ignore_above",
        0.6,
        (
            _slot(*_IGNORE),
            _slot("all", "everything", opt=True),
            _slot("the", opt=True),
            _slot("above", "previous", "preceding", "foregoing"),
        ),
    ),
    InjectionRule(
        "do_anything_now",
        0.6,
        (_slot("do anything now"),),
    ),
    InjectionRule(
        "ignore_rules",
        0.5,
        (
            _slot(*_IGNORE),
            _slot(*_QUANT, opt=True),
            _slot("of", opt=True),
            _slot(*_DET, opt=True),
            _slot(*_RULES),
        ),
    ),
    InjectionRule(
        "developer_mode_on",
        0.5,
        (
            _slot(
                "enable",
                "enter",
                "activate",
                "switch to",
                "switch into",
                "turn on",
                "unlock",
                "go into",
            ),
            _slot("the", opt=True),
            _slot("developer", "dev"),
            _slot("mode"),
        ),
    ),
    InjectionRule(
        "new_instructions",
        0.5,
        (
            _slot("new", "updated", "real", "actual", "true", "secret", "hidden", "revised"),
            _slot("system", opt=True),
            _slot("instructions", "prompt", "directive", "directives"),
        ),
    ),
    InjectionRule(
        "no_limits",
        0.4,
        (
            _slot("without", "with no", "free of", "free from"),
            _slot("any", "all", "the", opt=True),
            _slot("ethical", "moral", "content", "safety", opt=True),
            _slot(
                "restrictions",
                "limitations",
                "limits",
                "filters",
                "filtering",
                "censorship",
                "guidelines",
                "boundaries",
                "guardrails",
                "safeguards",
            ),
        ),
    ),
    InjectionRule("jailbreak", 0.4, (_slot("jailbreak", "jailbroken", "jailbreaking"),)),
    InjectionRule("from_now_on", 0.4, (_slot("from now on"), _slot("you", "your"))),
    InjectionRule("developer_mode", 0.3, (_slot("developer mode", "dev mode"),)),
)
# fmt: on


def injection_pattern(rules: Sequence[InjectionRule]) -> re.Pattern[str]:
    """One regex for all enabled rules, for lower-cased text; ``m.lastgroup`` names the rule."""
    body = "|".join(f"(?P<{r.name}>{phrase_regex(r.slots)})" for r in rules)
    return re.compile(rf"(?<!\w)(?:{body})(?!\w)")


def word_anchor(words: Iterable[str]) -> re.Pattern[str]:
    """Matches at the start of any of ``words`` (lower-case) that does not follow a word character.

    Built as a character trie whose top-level branches begin with a literal, so the regex
    engine skips in C to positions holding a possible first letter. It matches the shortest
    distinct prefixes only: it is a filter, the full pattern decides.
    """
    tree: dict[str, Any] = {}
    for word in words:
        if not word:
            continue
        node = tree
        for ch in word:
            if "" in node:
                break
            node = node.setdefault(ch, {})
        else:
            node.clear()
            node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        if "" in node or not node:
            return ""
        alts = [re.escape(ch) + emit(child) for ch, child in sorted(node.items())]
        return alts[0] if len(alts) == 1 else f"(?:{'|'.join(alts)})"

    # Words starting with a word character must not follow one (the patterns' (?<!\w)).
    top = [
        re.escape(ch) + (r"(?<!\w.)" if ch.isalnum() or ch == "_" else "") + emit(child)
        for ch, child in sorted(tree.items())
    ]
    return re.compile("|".join(top))


def blocklist_terms(terms: Iterable[str]) -> list[str]:
    """Blocklist terms with whitespace collapsed and lower-cased; empties and duplicates dropped."""
    seen: dict[str, None] = {}
    for term in terms:
        norm = " ".join(term.split()).lower()
        if norm:
            seen.setdefault(norm, None)
    return list(seen)


def blocklist_pattern(terms: Sequence[str]) -> tuple[re.Pattern[str], bool]:
    """Whole-word alternation of the (lower-case) terms, longest first.

    Returns the pattern and whether it expects ASCII-lower-cased text; terms with non-ASCII
    letters need real case folding, so they get ``re.IGNORECASE`` on the original text.
    """
    body = _alt(sorted(terms, key=lambda t: (-len(t), t)), _BLOCK_SEP)
    if all(t.isascii() for t in terms):
        return re.compile(rf"(?<!\w)(?:{body})(?!\w)"), True
    return re.compile(rf"(?<!\w)(?:{body})(?!\w)", re.IGNORECASE), False


def blocklist_reach(terms: Sequence[str]) -> int:
    return max((len(t) + 2 * t.count(" ") + 1 for t in terms), default=0)


# --- the hold-back tail ----------------------------------------------------------------------

# A suffix of a stream that could still grow into (or change) a match:
#  * the trailing run of non-space characters: e-mails, keys, tokens, words, partial terms;
#  * a trailing run of digits, capitals and separators starting with a digit, "+", "(" or "-"
#    (phone, card, SSN, PEM line), or with two capitals and a digit (IBAN, NI number);
#  * a chain of phrase words that begins like an injection phrase or blocklist term.
_TOKEN_TAIL = r"\S+"
_SPACED_TAIL = r"[+(\-0-9][0-9A-Z +\-().]*|[A-Z]{1,2}(?: ?[0-9][0-9A-Z ]*| )?"


DEFAULT_TAILS = (_TOKEN_TAIL, _SPACED_TAIL)


def tail_pattern(
    first_words: Iterable[str],
    vocabulary: Iterable[str],
    tails: Iterable[str] = DEFAULT_TAILS,
) -> re.Pattern[str]:
    """The regex whose leftmost match (anchored at the end) is where the stream must hold:
    any of ``tails``, or a chain of words that starts like a phrase (``first_words`` followed
    by words of ``vocabulary``)."""
    alts = list(dict.fromkeys(tails))
    first = sorted(set(first_words), key=lambda w: (-len(w), w))
    vocab = sorted(set(vocabulary), key=lambda w: (-len(w), w))
    if first:
        f = "|".join(map(re.escape, first))
        v = "|".join(map(re.escape, vocab))
        alts.append(
            rf"(?<!\w)(?i:{f})(?:{PHRASE_SEP}(?i:{v})(?!\w))*(?:{PHRASE_SEP}\S*)?"
            if vocab
            else rf"(?<!\w)(?i:{f})(?:{PHRASE_SEP}\S*)?"
        )
    if not alts:
        return re.compile(r"(?!)")  # nothing can still change: release everything
    return re.compile(rf"(?:{'|'.join(alts)})\Z")


_WORD_SPLIT = re.compile(r"\W+")
_ASCII_LOWER = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


def ascii_lower(text: str) -> str:
    """Lower-case ASCII letters only, so positions stay the same as in ``text``."""
    return text.lower() if text.isascii() else text.translate(_ASCII_LOWER)


def phrase_words(alternatives: Iterable[str]) -> tuple[set[str], set[str]]:
    """First words and vocabulary of phrase alternatives, for :func:`tail_pattern`."""
    first: set[str] = set()
    vocab: set[str] = set()
    for alt in alternatives:
        lower = alt.lower()
        first.add(lower.split(" ")[0])
        pieces = [p for p in _WORD_SPLIT.split(lower) if p]
        if pieces:
            first.add(pieces[0])
        vocab.update(pieces)
    return first, vocab
