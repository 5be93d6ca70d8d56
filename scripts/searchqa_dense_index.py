"""Build a flat FAISS index over a Search-R1 jsonl corpus with a local e5-style encoder.

    python scripts/searchqa_dense_index.py --corpus envs/data/searchqa/corpus.jsonl \
        --encoder /models/e5-base-v2 --out /data/searchqa-e5.index
    python train.py --env searchqa --env-options retriever dense corpus_path envs/data/searchqa/corpus.jsonl \
        index_path /data/searchqa-e5.index encoder_path /models/e5-base-v2

Passages are encoded as e5 expects ("passage: " + contents, mean pooling, L2-normalised) into an
inner-product index whose row i is line i of the corpus, as Search-R1's e5_Flat.index. On a CPU
this runs at tens of passages per second for a base-size encoder: fine for the shipped 8k-passage
corpus (minutes), not for wiki-18 (use Search-R1's published index, or the remote retriever).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs.searchqa.retrievers import PASSAGE_PREFIX, build_dense_index  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True, help="Search-R1 jsonl corpus")
    parser.add_argument("--encoder", type=Path, required=True, help="local Hugging Face encoder folder")
    parser.add_argument("--out", type=Path, required=True, help="FAISS index file to write")
    parser.add_argument("--passage-prefix", default=PASSAGE_PREFIX, help="prepended to every passage (e5: 'passage: ')")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    start = time.perf_counter()
    count = build_dense_index(args.corpus, args.encoder, args.out, args.passage_prefix, args.batch_size)
    print(f"{count} passages -> {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
