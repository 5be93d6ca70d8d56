"""Benchmark SearchQA's bm25 retriever: index build time, queries/s and recall@3.

    python scripts/bench_searchqa.py                       # shipped corpus + a 100k-passage synthetic one
    python scripts/bench_searchqa.py --passages 20000      # a smaller synthetic corpus

1. The shipped corpus (envs/data/searchqa/corpus.jsonl): build time of the bm25 index (tokenise,
   index, save; into a fresh temporary cache), load time from the cache, single-query searches/s
   with every shipped question as the query, and recall@3 per category: the share of questions whose
   top-3 passages contain a golden answer (Search-R1's retrieval check) when the question itself is
   the query, and the share whose first hop's passage is in the top 3.
2. A synthetic corpus in wiki-18's shape: `--passages` passages of `--words` words drawn from a
   Zipf distribution over a 50,000-word vocabulary; the same timings with random 4-word queries.

Timings on a shared 2-core machine are noisy; run it twice.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs.searchqa import normalize_answer  # noqa: E402
from envs.searchqa.data import EMBEDDED_CORPUS, EMBEDDED_QA  # noqa: E402
from envs.searchqa.retrievers import BM25Retriever, Corpus  # noqa: E402


def timed_index(corpus_path: Path, cache: Path) -> tuple[BM25Retriever, float, float]:
    start = time.perf_counter()
    built = BM25Retriever(Corpus(corpus_path), cache)
    build_s = time.perf_counter() - start
    assert built.built
    start = time.perf_counter()
    loaded = BM25Retriever(Corpus(corpus_path), cache)  # from the cache this time
    load_s = time.perf_counter() - start
    assert not loaded.built
    return loaded, build_s, load_s


def queries_per_second(retriever: BM25Retriever, queries: list[str]) -> float:
    start = time.perf_counter()
    for query in queries:
        retriever.search(query, 3)
    return len(queries) / (time.perf_counter() - start)


def shipped(cache: Path) -> None:
    corpus = Corpus(EMBEDDED_CORPUS)
    rows = [json.loads(line) for line in EMBEDDED_QA.read_text().splitlines()]
    retriever, build_s, load_s = timed_index(EMBEDDED_CORPUS, cache)
    qps = queries_per_second(retriever, [row["question"] for row in rows])
    print(f"shipped corpus: {len(corpus)} passages, {EMBEDDED_CORPUS.stat().st_size / 1e6:.1f} MB; "
          f"index build {build_s:.2f} s, load {load_s:.3f} s; {qps:.0f} queries/s ({len(rows)} questions)")

    answer, evidence = defaultdict(lambda: defaultdict(list)), defaultdict(lambda: defaultdict(list))
    for row in rows:
        docs = retriever.search(row["question"], 3)
        text = normalize_answer(" ".join(doc["contents"] for doc in docs))
        for split in (row["split"], "all"):
            answer[split][row["category"]].append(any(normalize_answer(a) in text for a in row["golden_answers"]))
            evidence[split][row["category"]].append(row["hops"][0]["doc"] in [doc["id"] for doc in docs])
    print("recall@3 with the question as the query (answer in top 3 / first hop's passage in top 3):")
    print(f"  {'category (hops)':20s} {'test':>13s} {'all':>13s}")
    for category in sorted(answer["all"]):
        hops = len(next(r for r in rows if r["category"] == category)["hops"])
        cells = [f"{np.mean(answer[s][category]):.3f} / {np.mean(evidence[s][category]):.3f}" for s in ("test", "all")]
        print(f"  {category + f' ({hops})':20s} {cells[0]:>13s} {cells[1]:>13s}")
    for split in ("test", "all"):
        hits = [h for cat in answer[split].values() for h in cat]
        first = [h for cat in evidence[split].values() for h in cat]
        print(f"  {'overall ' + split:20s} {np.mean(hits):.3f} / {np.mean(first):.3f}  ({len(hits)} questions)")


def synthetic(cache: Path, passages: int, words: int, queries: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(50_000)])
    ranks = np.minimum(rng.zipf(1.2, size=(passages, words)), len(vocab)) - 1
    path = cache / "synthetic.jsonl"
    start = time.perf_counter()
    with open(path, "w") as f:
        for i, row in enumerate(ranks):
            f.write(json.dumps({"id": str(i), "contents": f'"Passage {i}"\n{" ".join(vocab[row])}'}) + "\n")
    write_s = time.perf_counter() - start
    retriever, build_s, load_s = timed_index(path, cache)
    size_mb = sum(p.stat().st_size for p in retriever.index_dir.iterdir()) / 1e6
    picks = rng.integers(0, passages, size=queries)
    qs = [" ".join(vocab[ranks[p, rng.integers(0, words, size=4)]]) for p in picks]
    qps = queries_per_second(retriever, qs)
    print(f"synthetic corpus: {passages} passages x {words} words, {path.stat().st_size / 1e6:.0f} MB "
          f"(written in {write_s:.1f} s); index build {build_s:.1f} s, {size_mb:.0f} MB on disk, "
          f"load {load_s:.2f} s; {qps:.0f} queries/s ({queries} 4-word queries)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--words", type=int, default=100)
    parser.add_argument("--queries", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        shipped(Path(cache) / "shipped")
        synthetic(Path(cache), args.passages, args.words, args.queries)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
