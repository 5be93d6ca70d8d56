"""Retrievers for SearchQA: one interface, three real backends.

    retriever = get_retriever("bm25", corpus_path="wiki-18.jsonl")
    retriever.search("capital of France", k=3)   # -> [{"id": ..., "contents": "\"Title\"\ntext"}, ...]

- `bm25`: bm25s over a Search-R1 `wiki-18.jsonl`-format corpus (`{"id", "contents"}` per line), with
  pyserini's defaults (the BM25 that Search-R1 uses): Lucene scoring with k1 = 0.9, b = 0.4, the
  Porter stemmer and Lucene's 33 English stopwords; a term repeated in the query is scored once,
  weighted by its count, as pyserini's bag-of-words query does. The index is built once and cached
  on disk under a key made of the corpus's sha256 and these settings; it is written to a temporary
  folder and renamed into place, so a crash never leaves a half-written index behind.
- `dense`: a FAISS index file over the same corpus plus a local encoder folder, following e5 (the
  encoder upstream uses): "query: " prefix, mean pooling over the attention mask, L2-normalised,
  at most 256 tokens. torch, transformers and faiss are imported only when this backend is used.
  `build_dense_index` writes such an index ("passage: " prefix, inner product) for a small corpus.
- `remote`: a client for Search-R1's retrieval server (`POST /retrieve {"queries", "topk",
  "return_scores"}`), so a GPU box serving the full wiki-18 e5 index is used unchanged.

The corpus is read by line number with os.pread, never held in memory, so wiki-18 (21M passages,
14 GB) costs only its line offsets. One retriever per configuration is shared by every env
instance in the process; a lock serialises its searches, so env threads may call it freely.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from tqdm import tqdm

# pyserini's LuceneSearcher defaults, which Search-R1's bm25 retriever uses.
BM25_K1, BM25_B = 0.9, 0.4
BM25_STEMMER = "porter"
TOKEN_PATTERN = r"(?u)\b\w+\b"  # Lucene keeps one-character tokens ("vitamin c", symbol "H")
# e5 conventions (intfloat/e5-base-v2, upstream's encoder).
QUERY_PREFIX, PASSAGE_PREFIX, MAX_LENGTH = "query: ", "passage: ", 256


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "agentgym-rl" / "searchqa"


# ----------------------------------------------------------------------------------------------
# Corpus


class Corpus:
    """A Search-R1 jsonl corpus, read by line number (Search-R1's FAISS ids are line numbers)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(
                f"corpus {self.path} does not exist; pass corpus_path= a jsonl file with one "
                '{"id", "contents": "\\"Title\\"\\ntext"} passage per line (Search-R1\'s wiki-18.jsonl format)'
            )
        self.sha256, self._starts, self._ends = _scan(self.path)
        self._fd = os.open(self.path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i: int) -> dict:
        start, end = int(self._starts[i]), int(self._ends[i])
        return json.loads(os.pread(self._fd, end - start, start))

    def contents(self):
        """Every passage's `contents`, in order, streamed."""
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)["contents"]

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


def _scan(path: Path, chunk: int = 1 << 24) -> tuple[str, np.ndarray, np.ndarray]:
    """One pass over the file: its sha256 and the byte span of every non-empty line."""
    digest = hashlib.sha256()
    newlines, size = [], 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            newlines.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10) + size)
            size += len(block)
    ends = np.concatenate(newlines + [np.array([size])]).astype(np.int64)  # a line ends at its "\n"
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    nonblank = ends > starts
    return digest.hexdigest(), starts[nonblank], ends[nonblank]


# ----------------------------------------------------------------------------------------------
# Backends


LARGE_CORPUS = 100_000  # passages; a smaller index builds in seconds, without progress bars


class BM25Retriever:
    def __init__(self, corpus: Corpus, cache_dir: str | Path | None = None):
        import bm25s
        import Stemmer

        self.corpus = corpus
        self._bm25s = bm25s
        self._stemmer = Stemmer.Stemmer(BM25_STEMMER)
        self._lock = threading.Lock()
        settings = f"bm25s={bm25s.__version__} k1={BM25_K1} b={BM25_B} stem={BM25_STEMMER} tok={TOKEN_PATTERN}"
        key = hashlib.sha256(f"{corpus.sha256} {settings}".encode()).hexdigest()[:16]
        self.index_dir = Path(cache_dir or default_cache_dir()).expanduser() / f"bm25-{key}"
        self.built = False  # whether this process built the index (False: loaded from the cache)
        if not (self.index_dir / "params.index.json").is_file():
            self._build()
            self.built = True
        self.bm25 = bm25s.BM25.load(str(self.index_dir), mmap=True, load_corpus=False)

    def _tokenize(self, texts, return_ids: bool):
        return self._bm25s.tokenize(texts, token_pattern=TOKEN_PATTERN, stopwords="en", stemmer=self._stemmer,
                                    return_ids=return_ids, show_progress=False)

    def _build(self) -> None:
        self.index_dir.parent.mkdir(parents=True, exist_ok=True)
        bm25 = self._bm25s.BM25(k1=BM25_K1, b=BM25_B, method="lucene")
        large = len(self.corpus) >= LARGE_CORPUS  # minutes to hours: say so, and show bm25s's progress bars
        if large:
            print(f"searchqa: building the BM25 index of {len(self.corpus):,} passages once, into {self.index_dir}")
        tokens = self._bm25s.tokenize(list(self.corpus.contents()), token_pattern=TOKEN_PATTERN, stopwords="en",
                                      stemmer=self._stemmer, return_ids=True, show_progress=large)
        bm25.index(tokens, show_progress=large)
        tmp = Path(tempfile.mkdtemp(prefix=self.index_dir.name + ".tmp-", dir=self.index_dir.parent))
        try:
            bm25.save(str(tmp), show_progress=False)
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
            os.rename(tmp, self.index_dir)
        except OSError:
            if not (self.index_dir / "params.index.json").is_file():
                raise
            # another process finished the same index first; theirs is identical
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def search(self, query: str, k: int) -> list[dict]:
        with self._lock:
            tokens = self._tokenize([query], return_ids=False)[0]
            token_ids = self.bm25.get_tokens_ids(tokens)
            if not token_ids:
                return []  # as Lucene: a query with no indexed term matches nothing
            # pyserini's bag-of-words query: one clause per distinct term, boosted by its count. Scoring
            # every repeat instead cost the query's length times the term's postings (3 s here for
            # "state " * 250000; hours on wiki-18); this is one scoring pass per distinct count.
            counts = collections.Counter(token_ids)  # in query order, so a query without repeats sums as before
            scores = sum(k * self.bm25.get_scores_from_ids([t for t, n in counts.items() if n == k])
                         for k in dict.fromkeys(counts.values()))
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.lexsort((top, -scores[top]))]  # by score, ties by line number
        return [self.corpus[int(i)] for i in top if scores[i] > 0]


class Encoder:
    """An e5-style sentence encoder from a local Hugging Face folder: mean pooling, L2-normalised."""

    def __init__(self, path: str | Path, max_length: int = MAX_LENGTH):
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = Path(path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"encoder folder {path} has no config.json; pass encoder_path= a local "
                                    "Hugging Face model folder such as a download of intfloat/e5-base-v2")
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        dtype = torch.float16 if self.device == "cuda" else torch.float32
        self.model = AutoModel.from_pretrained(path, local_files_only=True, dtype=dtype).to(self.device).eval()
        self.max_length = max_length

    def encode(self, texts: list[str]) -> np.ndarray:
        torch = self.torch
        batch = self.tokenizer(texts, max_length=self.max_length, padding=True, truncation=True, return_tensors="pt")
        batch = {name: tensor.to(self.device) for name, tensor in batch.items()}
        with torch.no_grad():
            hidden = self.model(**batch).last_hidden_state  # (batch, tokens, dim)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
        pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
        return pooled.cpu().numpy().astype(np.float32)


class DenseRetriever:
    def __init__(self, corpus: Corpus, index_path: str | Path, encoder_path: str | Path,
                 query_prefix: str = QUERY_PREFIX):
        import faiss

        index_path = Path(index_path).expanduser()
        if not index_path.is_file():
            raise FileNotFoundError(f"FAISS index {index_path} does not exist; pass index_path= the index over "
                                    "corpus_path (e.g. Search-R1's e5_Flat.index), or build one with "
                                    "scripts/searchqa_dense_index.py")
        self.corpus = corpus
        self.index = faiss.read_index(str(index_path))
        if self.index.ntotal != len(corpus):
            raise ValueError(f"FAISS index {index_path} holds {self.index.ntotal} vectors but corpus "
                             f"{corpus.path} has {len(corpus)} passages; they must be built from the same file")
        self.encoder = Encoder(encoder_path)
        self.query_prefix = query_prefix
        self._lock = threading.Lock()

    def search(self, query: str, k: int) -> list[dict]:
        with self._lock:
            vectors = self.encoder.encode([self.query_prefix + query])
            _, ids = self.index.search(vectors, k)
        return [self.corpus[int(i)] for i in ids[0] if i >= 0]


def build_dense_index(corpus_path: str | Path, encoder_path: str | Path, index_path: str | Path,
                      passage_prefix: str = PASSAGE_PREFIX, batch_size: int = 64) -> int:
    """Encode every passage's `contents` (e5: "passage: " prefix) into a flat inner-product FAISS
    index at `index_path` (written to a temporary file, then renamed). Returns the passage count.
    Encoding is slow on a CPU (about 60 passages/s for a MiniLM): meant for small corpora."""
    import faiss

    corpus, encoder = Corpus(corpus_path), Encoder(encoder_path)
    index, batch = None, []

    def flush():
        nonlocal index
        vectors = encoder.encode([passage_prefix + text for text in batch])
        index = index or faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
        batch.clear()

    for text in tqdm(corpus.contents(), total=len(corpus), desc="encoding passages", unit="passage"):
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    index_path = Path(index_path)
    index_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = index_path.with_name(index_path.name + ".tmp")
    faiss.write_index(index, str(tmp))
    os.replace(tmp, index_path)
    return index.ntotal


class RemoteRetriever:
    """Search-R1's retrieval server: `POST {url}/retrieve`. Network errors raise (a dead retriever
    is an infrastructure failure: the rollout ends that one trajectory)."""

    def __init__(self, url: str, timeout: float = 60.0):
        self.url = url.rstrip("/")
        if not self.url.endswith("/retrieve"):
            self.url += "/retrieve"
        self.timeout = float(timeout)

    def search(self, query: str, k: int) -> list[dict]:
        body = json.dumps({"queries": [query], "topk": k, "return_scores": True}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                result = json.loads(response.read())["result"][0]
        except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as error:
            raise RuntimeError(f"retrieval server {self.url} failed: {error}") from error
        # With return_scores the server sends [{"document": doc, "score": s}], without it bare docs.
        docs = [hit["document"] if "document" in hit else hit for hit in result]
        for doc in docs:
            if "contents" not in doc:  # FlashRAG-style documents carry title and text instead
                doc["contents"] = f'"{doc.get("title", "")}"\n{doc.get("text", "")}'
        return docs


# ----------------------------------------------------------------------------------------------
# One shared retriever per configuration

_RETRIEVERS: dict[tuple, object] = {}
_CORPORA: dict[Path, Corpus] = {}
_LOCK = threading.Lock()


def get_retriever(kind: str = "bm25", corpus_path: str | Path | None = None, index_path: str | Path | None = None,
                  encoder_path: str | Path | None = None, retrieval_url: str | None = None,
                  cache_dir: str | Path | None = None, query_prefix: str = QUERY_PREFIX, timeout: float = 60.0):
    key = (kind, str(corpus_path), str(index_path), str(encoder_path), retrieval_url, str(cache_dir), query_prefix,
           float(timeout))
    with _LOCK:
        if key not in _RETRIEVERS:
            if kind == "remote":
                if not retrieval_url:
                    raise ValueError("retriever=remote needs retrieval_url= the Search-R1 server, "
                                     "e.g. http://gpu-box:8000/retrieve")
                _RETRIEVERS[key] = RemoteRetriever(retrieval_url, timeout)
            elif kind in ("bm25", "dense"):
                if corpus_path is None:
                    raise ValueError(f"retriever={kind} needs corpus_path= a Search-R1 jsonl corpus")
                path = Path(corpus_path).expanduser().resolve()
                if path not in _CORPORA:
                    _CORPORA[path] = Corpus(path)
                if kind == "bm25":
                    _RETRIEVERS[key] = BM25Retriever(_CORPORA[path], cache_dir)
                else:
                    if index_path is None or encoder_path is None:
                        raise ValueError("retriever=dense needs index_path= a FAISS index over corpus_path and "
                                         "encoder_path= a local encoder folder (e.g. e5-base-v2)")
                    _RETRIEVERS[key] = DenseRetriever(_CORPORA[path], index_path, encoder_path, query_prefix)
            else:
                raise ValueError(f"unknown retriever {kind!r}; choose bm25, dense or remote")
        return _RETRIEVERS[key]
