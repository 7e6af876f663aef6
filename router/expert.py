"""Expert Router's prompt classifier: TF-IDF -> truncated SVD -> standardise -> k-means.

``tokenbus router train --data prompts.jsonl --clusters K --out DIR`` fits it and writes two
files, no pickle anywhere: ``expert.npz`` (plain float arrays: idf, the SVD components, the
standardisation and the centroids, loaded with ``allow_pickle=False``) and ``expert.json``
(the vocabulary, the stop words, the parameters and what each cluster holds). The router
loads them and sends each prompt to the model or pool the configuration maps its cluster
(or the cluster's majority label) to.

Text handling: lower-cased words of letters, every run of digits replaced by one ``<num>``
token (numbers carry topic, not identity), English stop words removed; TF is ``1 + log(count)``,
IDF the smoothed ``log((1 + n) / (1 + df)) + 1``, rows L2-normalised.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from services.datafiles import read_lines

F = npt.NDArray[np.float64]

NUM = "<num>"
_WORD = re.compile(r"[a-z]+|\d+")

_STOP = """
    a about above after again against all am an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for
    from further had has have having he her here hers herself him himself his how i if in
    into is it its itself just me more most my myself no nor not now of off on once only
    or other our ours ourselves out over own same she should so some such than that the
    their theirs them themselves then there these they this those through to too under
    until up very was we were what when where which while who whom why will with would you
    your yours yourself yourselves please tell give make let us get want need like also
    may might must shall
"""
STOP_WORDS = frozenset(_STOP.split())


def tokens(text: str) -> list[str]:
    out = []
    for w in _WORD.findall(text.lower()):
        if w[0].isdigit():
            out.append(NUM)
        elif w not in STOP_WORDS and len(w) > 1:
            out.append(w)
    return out


@dataclass
class Example:
    prompt: str
    label: str | None = None


def read_examples(path: str | Path) -> list[Example]:
    """JSONL lines ``{"prompt": ..., "label": ...}`` (label optional), or plain text lines."""
    out: list[Example] = []
    for n, row in read_lines(path):
        if isinstance(row, str):
            out.append(Example(row))
            continue
        prompt = row.get("prompt") or row.get("text")
        if not isinstance(prompt, str):
            raise ValueError(f'{path}:{n}: needs a "prompt" string')
        label = row.get("label")
        out.append(Example(prompt, str(label) if label is not None else None))
    return out


class ExpertModel:
    """A fitted classifier: ``classify(prompt)`` -> cluster index."""

    def __init__(
        self,
        vocab: list[str],
        idf: F,
        components: F,
        mean: F,
        scale: F,
        centroids: F,
        meta: dict[str, Any],
    ) -> None:
        self.vocab = vocab
        self.index = {t: i for i, t in enumerate(vocab)}
        self.idf = idf
        # (vocab, dims): a prompt's projection is a weighted sum of a few of its rows.
        self.components_t = np.ascontiguousarray(components.T)
        self.mean = mean
        self.scale = scale
        self.centroids = centroids
        self.meta = meta

    @property
    def clusters(self) -> int:
        return int(self.centroids.shape[0])

    def labels(self) -> dict[int, str]:
        """Cluster -> the majority label of its training prompts (when they had labels)."""
        return {int(k): v for k, v in (self.meta.get("cluster_labels") or {}).items()}

    def _weights(self, text: str) -> tuple[list[int], F]:
        counts = Counter(i for t in tokens(text) if (i := self.index.get(t)) is not None)
        if not counts:
            return [], np.zeros(0)
        idx = list(counts)
        w = np.array([1.0 + math.log(counts[i]) for i in idx]) * self.idf[idx]
        return idx, w / np.linalg.norm(w)

    def embed(self, text: str) -> F:
        idx, w = self._weights(text)
        z = w @ self.components_t[idx] if idx else np.zeros(self.components_t.shape[1])
        scaling = str(self.meta.get("scaling", "zscore"))
        out: F = scale_rows(z[None, :], scaling, self.mean, self.scale)[0]
        return out

    def classify(self, text: str) -> int:
        """The nearest cluster, or -1 for a prompt with no word of the vocabulary."""
        if not any(t in self.index for t in tokens(text)):
            return -1
        z = self.embed(text)
        return int(np.argmin(((self.centroids - z) ** 2).sum(axis=1)))

    # -- files ---------------------------------------------------------------------------

    def save(self, out_dir: str | Path) -> None:
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        np.savez(
            d / "expert.npz",
            idf=self.idf,
            components=np.ascontiguousarray(self.components_t.T),
            mean=self.mean,
            scale=self.scale,
            centroids=self.centroids,
        )
        meta = {**self.meta, "vocab": self.vocab, "stop_words": sorted(STOP_WORDS)}
        (d / "expert.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, model_dir: str | Path) -> ExpertModel:
        d = Path(model_dir)
        meta = json.loads((d / "expert.json").read_text(encoding="utf-8"))
        with np.load(d / "expert.npz", allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k], dtype=np.float64) for k in z.files}
        vocab = [str(t) for t in meta.pop("vocab")]
        meta.pop("stop_words", None)
        return cls(
            vocab,
            arrays["idf"],
            arrays["components"],
            arrays["mean"],
            arrays["scale"],
            arrays["centroids"],
            meta,
        )


SCALINGS = ("l2", "zscore")


def scale_rows(z: F, scaling: str, mean: F, scale: F) -> F:
    """The standardisation step on rows of SVD coordinates."""
    if scaling == "zscore":
        return np.asarray((z - mean) / scale, dtype=np.float64)
    norms = np.linalg.norm(z, axis=1, keepdims=True)
    return np.asarray(z / np.where(norms == 0, 1.0, norms), dtype=np.float64)


def _kmeans(x: F, k: int, rng: np.random.Generator, iters: int = 100) -> tuple[F, float]:
    """Lloyd's k-means from a k-means++ start; returns (centroids, inertia)."""
    n = x.shape[0]
    centroids: F = np.empty((k, x.shape[1]))
    centroids[0] = x[rng.integers(n)]
    d2 = ((x - centroids[0]) ** 2).sum(axis=1)
    for j in range(1, k):
        total = d2.sum()
        i = int(rng.choice(n, p=d2 / total)) if total > 0 else int(rng.integers(n))
        centroids[j] = x[i]
        d2 = np.minimum(d2, ((x - centroids[j]) ** 2).sum(axis=1))
    assign = np.zeros(n, dtype=np.int64)
    for it in range(iters):
        dist = ((x[:, None, :] - centroids[None, :, :]) ** 2).sum(axis=2)
        new = dist.argmin(axis=1)
        if it and np.array_equal(new, assign):
            break
        assign = new
        for j in range(k):
            members = x[assign == j]
            if len(members):
                centroids[j] = members.mean(axis=0)
    dist = ((x[:, None, :] - centroids[None, :, :]) ** 2).sum(axis=2)
    return centroids, float(dist.min(axis=1).sum())


def fit(
    prompts: Sequence[str],
    clusters: int,
    *,
    dims: int = 100,
    min_df: int = 2,
    max_features: int = 20_000,
    seed: int = 0,
    n_init: int = 5,
    labels: Sequence[str | None] | None = None,
    scaling: str = "l2",
) -> ExpertModel:
    """Fit the pipeline on ``prompts``; ``labels`` (optional) name each cluster's majority.

    ``scaling`` is how the SVD embedding is standardised before k-means: ``zscore`` (each
    dimension to zero mean and unit variance, as Expert Router does) or ``l2`` (each prompt's
    vector to unit length: cosine geometry, which keeps the SVD's ordering of dimensions by
    importance; on the shipped prompt set it clusters far better, see docs/routing.md).
    """
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}")
    if clusters < 1:
        raise ValueError("clusters must be at least 1")
    if len(prompts) < clusters:
        raise ValueError(f"{len(prompts)} prompts cannot make {clusters} clusters")
    docs = [Counter(tokens(p)) for p in prompts]
    df = Counter(t for d in docs for t in d)
    terms = [t for t, c in df.items() if c >= min_df] or list(df)
    terms = sorted(terms, key=lambda t: (-df[t], t))[:max_features]
    if not terms:
        raise ValueError("the prompts have no words to learn from")
    vocab = sorted(terms)
    index = {t: i for i, t in enumerate(vocab)}
    n = len(docs)
    idf = np.array([math.log((1 + n) / (1 + df[t])) + 1.0 for t in vocab])
    x = np.zeros((n, len(vocab)))
    for row, d in enumerate(docs):
        for t, c in d.items():
            i = index.get(t)
            if i is not None:
                x[row, i] = (1.0 + math.log(c)) * idf[i]
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.where(norms == 0, 1.0, norms)
    k_dims = max(1, min(dims, min(x.shape) - 1)) if min(x.shape) > 1 else 1
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    components = vt[:k_dims]
    z = x @ components.T
    mean = z.mean(axis=0)
    scale = z.std(axis=0)
    scale = np.where(scale < 1e-12, 1.0, scale)
    zs = scale_rows(z, scaling, mean, scale)
    rng = np.random.default_rng(seed)
    best: tuple[F, float] | None = None
    for _ in range(n_init):
        cent, inertia = _kmeans(zs, clusters, rng)
        if best is None or inertia < best[1]:
            best = (cent, inertia)
    assert best is not None
    centroids = best[0]
    assign = ((zs[:, None, :] - centroids[None, :, :]) ** 2).sum(axis=2).argmin(axis=1)
    meta: dict[str, Any] = {
        "format": 1,
        "scaling": scaling,
        "clusters": clusters,
        "dims": k_dims,
        "min_df": min_df,
        "trained_on": n,
        "cluster_sizes": {str(j): int((assign == j).sum()) for j in range(clusters)},
        "cluster_terms": _top_terms(x, assign, vocab, clusters),
    }
    if labels is not None and any(lb is not None for lb in labels):
        meta["cluster_labels"] = majority_labels(assign.tolist(), labels, clusters)
    return ExpertModel(vocab, idf, components, mean, scale, centroids, meta)


def _top_terms(x: F, assign: Any, vocab: list[str], clusters: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for j in range(clusters):
        members = x[assign == j]
        if not len(members):
            out[str(j)] = []
            continue
        top = np.argsort(-members.mean(axis=0))[:8]
        out[str(j)] = [vocab[i] for i in top]
    return out


def majority_labels(
    assign: Sequence[int], labels: Sequence[str | None], clusters: int
) -> dict[str, str]:
    out: dict[str, str] = {}
    for j in range(clusters):
        c = Counter(lb for a, lb in zip(assign, labels, strict=True) if a == j and lb is not None)
        if c:
            out[str(j)] = c.most_common(1)[0][0]
    return out


def purity(assign: Sequence[int], labels: Sequence[str]) -> float:
    """Share of prompts whose cluster's majority label is their own label."""
    by: dict[int, Counter[str]] = {}
    for a, lb in zip(assign, labels, strict=True):
        by.setdefault(a, Counter())[lb] += 1
    return sum(c.most_common(1)[0][1] for c in by.values()) / max(1, len(labels))


def split(
    examples: Sequence[Example], holdout: float, seed: int
) -> tuple[list[Example], list[Example]]:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(examples))
    cut = len(examples) - round(len(examples) * holdout)
    return [examples[i] for i in order[:cut]], [examples[i] for i in order[cut:]]


def train(
    data: str | Path,
    clusters: int,
    out_dir: str | Path,
    *,
    holdout: float = 0.2,
    seed: int = 0,
    dims: int = 100,
    scaling: str = "l2",
) -> dict[str, Any]:
    """Fit on ``data`` minus a held-out share, save, and report purity and speed."""
    examples = read_examples(data)
    fit_on, held = split(examples, holdout, seed) if holdout > 0 else (list(examples), [])
    model = fit(
        [e.prompt for e in fit_on],
        clusters,
        dims=dims,
        seed=seed,
        labels=[e.label for e in fit_on],
        scaling=scaling,
    )
    report: dict[str, Any] = {
        "out": str(out_dir),
        "trained_on": len(fit_on),
        "held_out": len(held),
        "clusters": clusters,
        "scaling": scaling,
        "dims": model.meta["dims"],
        "vocabulary": len(model.vocab),
        "cluster_sizes": model.meta["cluster_sizes"],
        "cluster_labels": model.meta.get("cluster_labels", {}),
        "cluster_terms": model.meta["cluster_terms"],
    }
    labelled = [e for e in held if e.label is not None]
    if labelled:
        assign = [model.classify(e.prompt) for e in labelled]
        report["held_out_purity"] = round(purity(assign, [str(e.label) for e in labelled]), 4)
        names = model.labels()
        hits = sum(names.get(a) == e.label for a, e in zip(assign, labelled, strict=True))
        report["held_out_accuracy"] = round(hits / len(labelled), 4)
    report["classify_us"] = classify_cost_us(model, [e.prompt for e in examples])
    model.meta["report"] = {k: v for k, v in report.items() if k.startswith("held_out")}
    model.save(out_dir)
    return report


def classify_cost_us(
    model: ExpertModel, prompts: Iterable[str], rounds: int = 3
) -> dict[str, float]:
    """Microseconds per classification: median and p99 over the prompts."""
    samples: list[float] = []
    items = list(prompts)
    for _ in range(rounds):
        for p in items:
            t = time.perf_counter_ns()
            model.classify(p)
            samples.append((time.perf_counter_ns() - t) / 1000)
    samples.sort()
    return {
        "p50": round(samples[len(samples) // 2], 1),
        "p99": round(samples[min(len(samples) - 1, int(len(samples) * 0.99))], 1),
    }
