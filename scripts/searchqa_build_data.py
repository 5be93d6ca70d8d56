"""Build SearchQA's embedded corpus and QA set from text that Debian packages ship.

    apt-get install -y wordnet-base miscfiles dict-elements
    python scripts/searchqa_build_data.py            # writes envs/data/searchqa/ and envs/data/searchqa_{train,test}.json

(Or `apt-get download` the three packages, `dpkg-deb -x` them into one folder and pass --root.)

Sources, each with its licence notice copied into envs/data/searchqa/NOTICE.md:
- wordnet-base (WordNet 3.0): the gloss of every named-entity noun synset (those with an instance
  hypernym: people, places, works, events; about 7,700);
- miscfiles (GNU): countries.gz (ISO codes and capital of 243 countries and territories) and
  currency.gz (ISO 4217); the facts are restated as sentences;
- dict-elements (the Elements database, public domain): the periodic table entries.

The corpus is Search-R1's wiki-18.jsonl format, `{"id": "<line>", "contents": "\"Title\"\ntext"}`.
Questions follow FlashRAG's (`question`, `golden_answers`) plus `id`, `split`, `category` and `hops`
(what a scripted expert searches for, which passage answers it, and what it finds there):

  single hop  capital            What is the capital of Peru?
              country            Lima is the capital of which country?
              currency           What is the currency of Japan?
              element-symbol     What is the chemical symbol of tungsten?
              element-number     Which chemical element has atomic number 26?
              wordnet            Who was the physicist born in Germany who formulated ...?
  two hops    city-capital       What is the capital of the country where the city of Lyon is located?
              capital-currency   What is the currency of the country whose capital is Lima?
              element-next       Which chemical element has an atomic number one greater than iron?

A question is kept only if every hop's passage is in bm25's top 3 for the expert's query, so the
expert's transcripts are consistent; the question text itself is not used for that filter (its
recall is what scripts/bench_searchqa.py reports). Split: 20% test per category, seeded.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envs  # noqa: E402
from envs.searchqa.data import DATA_DIR, EMBEDDED_BASE  # noqa: E402
from envs.searchqa.retrievers import BM25Retriever, Corpus  # noqa: E402

PACKAGES = "wordnet-base miscfiles dict-elements"
TEST_FRACTION = 0.2
WORDNET_QUESTIONS = 800  # the wordnet category is sampled down to this many
# ISO 4217 fund codes and a superseded code: not "the" currency of their country.
NOT_A_COUNTRYS_CURRENCY = {"BOV", "CLF", "COU", "MXV", "USN", "USS", "MGF"}
TOP_K = 3


# ----------------------------------------------------------------------------------------------
# Reading the packages


def read_wordnet(root: Path) -> dict[str, dict]:
    """Noun synsets: offset -> {lex, words, pointers [(symbol, offset, pos)], gloss}."""
    synsets = {}
    with open(root / "usr/share/wordnet/data.noun", encoding="latin-1") as f:
        for line in f:
            if line.startswith("  "):  # the licence header
                continue
            head, _, gloss = line.partition(" | ")
            fields = head.split()
            count = int(fields[3], 16)
            words = [fields[4 + 2 * i].replace("_", " ") for i in range(count)]
            i = 4 + 2 * count
            pointers = [(fields[i + 1 + 4 * p], fields[i + 2 + 4 * p], fields[i + 3 + 4 * p]) for p in range(int(fields[i]))]
            synsets[fields[0]] = {"lex": int(fields[1]), "words": words, "pointers": pointers, "gloss": gloss.strip()}
    return synsets


def read_countries(root: Path) -> list[dict]:
    rows = []
    for line in gzip.open(root / "usr/share/misc/countries.gz", "rt", encoding="utf-8"):
        if line.startswith("#") or not line.strip():
            continue
        un, iso2, iso3, name, capital = line.rstrip("\n").split(":", 4)
        rows.append({"un": un, "iso2": iso2, "iso3": iso3, "name": name, "capital": capital.strip()})
    return rows


def read_currencies(root: Path) -> list[dict]:
    rows = []
    for line in gzip.open(root / "usr/share/misc/currency.gz", "rt", encoding="utf-8"):
        if line.startswith("#") or not line.strip():
            continue
        code, number, name = line.rstrip("\n").split(":", 2)
        rows.append({"code": code, "number": number, "name": name.strip()})
    return rows


def read_elements(root: Path) -> list[dict]:
    """dictd entries in index order: {word, body}. The .dz is gzip-compatible; the text is latin-1."""
    raw = gzip.open(root / "usr/share/dictd/elements.dict.dz", "rb").read()
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def number(b64: str) -> int:
        value = 0
        for ch in b64:
            value = value * 64 + alphabet.index(ch)
        return value

    entries = []
    for line in open(root / "usr/share/dictd/elements.index", encoding="utf-8"):
        word, offset, length = line.rstrip("\n").split("\t")
        if word.startswith("00database"):
            continue
        text = raw[number(offset):number(offset) + number(length)].decode("latin-1")
        body = text.split("\n", 1)[1] if "\n" in text else ""
        entries.append({"word": word, "body": body.strip()})
    return entries


def notice(root: Path, package: str) -> str:
    return (root / f"usr/share/doc/{package}/copyright").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Passages


def passage(title: str, text: str) -> str:
    return f'"{title}"\n{" ".join(text.split())}'


def build(root: Path):
    synsets = read_wordnet(root)
    countries = read_countries(root)
    currencies = read_currencies(root)
    elements = read_elements(root)
    docs: list[str] = []

    def add(title: str, text: str) -> str:
        docs.append(passage(title, text))
        return str(len(docs) - 1)

    by_iso2 = {c["iso2"]: c for c in countries}
    for c in countries:
        text = f"{c['name']} is a country or territory with the ISO 3166 codes {c['iso2']} and {c['iso3']} " \
               f"(UN M49 code {c['un']})."
        if c["capital"]:
            text += f" Its capital is {c['capital']}."
        c["doc"] = add(c["name"], text)

    for cur in currencies:
        country = by_iso2.get(cur["code"][:2])
        if country and cur["code"] not in NOT_A_COUNTRYS_CURRENCY:
            cur["country"] = country
            what = f"is the currency of {country['name']}"
        else:
            what = "is an ISO 4217 currency"
        cur["doc"] = add(cur["name"], f"The {cur['name']} (ISO 4217 code {cur['code']}, number {cur['number']}) {what}.")

    records = {}
    for entry in elements:
        body = " ".join(entry["body"].replace("{", "").replace("}", "").split())
        entry["doc"] = add(entry["word"].capitalize(), f"{entry['word'].capitalize()}. {body}")
        symbol = re.search(r"Symbol: *(\S+)", entry["body"])
        atomic = re.search(r"Atomic number: *(\d+)", entry["body"])
        if symbol and atomic and not entry["word"].startswith(("unn", "unu")):  # skip temporary IUPAC names
            records.setdefault(int(atomic.group(1)), {**entry, "symbol": symbol.group(1), "number": int(atomic.group(1)),
                                                      "names": [entry["word"]]})
    by_word = {r["word"]: r for r in records.values()}
    for entry in elements:  # "Same as {aluminum}", "Original name for {tungsten}": other names
        refs = re.findall(r"\{(\w+)\}", entry["body"])
        if len(entry["body"]) < 80 and len(refs) == 1 and refs[0] in by_word and "Symbol:" not in entry["body"]:
            by_word[refs[0]]["names"].append(entry["word"])

    instances = {off: s for off, s in sorted(synsets.items()) if any(p[0] == "@i" for p in s["pointers"])}
    for off, s in instances.items():
        s["doc"] = add(s["words"][0], f"{', '.join(s['words'])}: {s['gloss']}")

    return docs, countries, currencies, records, synsets, instances


# ----------------------------------------------------------------------------------------------
# Questions


def hop(search: str, find: str, doc: str) -> dict:
    return {"search": search, "find": find, "doc": doc}


def questions(countries, currencies, records, synsets, instances, rng: random.Random) -> list[dict]:
    out = []

    def ask(category, question, answers, hops):
        out.append({"question": question, "golden_answers": list(dict.fromkeys(answers)), "category": category,
                    "hops": hops})

    # WordNet's other names for a country, when a named-entity synset has exactly its name.
    wordnet_names = defaultdict(list)
    for s in instances.values():
        wordnet_names[s["words"][0]].append(s)
    # WordNet's names for a capital: the synset with the lemma "capital of <country>" (Mexico City,
    # Mexican capital, capital of Mexico), less the lemmas that merely restate the question.
    capital_names = defaultdict(list)
    for s in instances.values():
        for word in s["words"]:
            if word.startswith("capital of "):
                capital_names[word[len("capital of "):]] += [w for w in s["words"] if "capital" not in w.lower()]
    capital_count = Counter(c["capital"] for c in countries)
    single = [c for c in countries if c["capital"] and "(" not in c["capital"] and capital_count[c["capital"]] == 1]
    for c in single:
        capitals = [c["capital"]] + ([c["capital"].split(",")[0]] if "," in c["capital"] else [])
        capitals += capital_names.get(c["name"], [])
        c["capitals"] = capitals
        names = [c["name"]] + [w for s in wordnet_names.get(c["name"], []) if s["lex"] == 15 for w in s["words"]]
        c["answers"] = names
        ask("capital", f"What is the capital of {c['name']}?", capitals, [hop(f"capital of {c['name']}", c["capital"], c["doc"])])
        ask("country", f"{c['capital']} is the capital of which country?", names,
            [hop(f"{c['capital']} capital", c["name"], c["doc"])])

    per_country = Counter(cur["country"]["iso2"] for cur in currencies if "country" in cur)
    for cur in currencies:
        if "country" not in cur or per_country[cur["country"]["iso2"]] > 1:
            continue
        country = cur["country"]
        ask("currency", f"What is the currency of {country['name']}?", [cur["name"]],
            [hop(f"currency of {country['name']}", cur["name"], cur["doc"])])
        if country in single:
            ask("capital-currency", f"What is the currency of the country whose capital is {country['capital']}?",
                [cur["name"]], [hop(f"{country['capital']} capital", country["name"], country["doc"]),
                                hop(f"currency of {country['name']}", cur["name"], cur["doc"])])

    for n, r in sorted(records.items()):
        name = r["word"]
        ask("element-symbol", f"What is the chemical symbol of {name}?", [r["symbol"]],
            [hop(name, f"symbol {r['symbol']}", r["doc"])])
        ask("element-number", f"Which chemical element has atomic number {n}?", r["names"],
            [hop(f"atomic number {n}", name, r["doc"])])
        if n + 1 in records:
            nxt = records[n + 1]
            ask("element-next", f"Which chemical element has an atomic number one greater than {name}?", nxt["names"],
                [hop(name, f"atomic number {n}", r["doc"]), hop(f"atomic number {n + 1}", nxt["word"], nxt["doc"])])

    # Two hops through WordNet: a city's gloss names its country (WordNet's part holonym), whose
    # capital comes from miscfiles.
    country_by_name = {c["name"]: c for c in single}
    city_words = {"city", "metropolis", "town", "port"}
    for s in instances.values():
        city = s["words"][0]
        hypernyms = [synsets[o] for sym, o, pos in s["pointers"] if sym == "@i"]
        holonyms = [synsets[o] for sym, o, pos in s["pointers"] if sym == "#p" and pos == "n"]
        if not any(city_words & set(h["words"]) for h in hypernyms) or len(wordnet_names[city]) > 1:
            continue
        for h in holonyms:
            country = next((country_by_name[w] for w in h["words"] if w in country_by_name), None)
            named = next((w for w in h["words"] if re.search(rf"\b{re.escape(w)}\b", s["gloss"])), None)
            if country and named and city not in country["capital"]:
                ask("city-capital", f"What is the capital of the country where the city of {city} is located?",
                    country["capitals"], [hop(city, named, s["doc"]),
                                           hop(f"capital of {country['name']}", country["capital"], country["doc"])])

    # Descriptions of named entities: the first clause of the gloss, with no word of the name in it.
    clauses = Counter()
    candidates = []
    for s in instances.values():
        clause = re.sub(r"^\([^)]*\)\s*", "", s["gloss"].split(";")[0]).strip()
        clauses[clause.lower()] += 1
        name_words = {w.lower() for lemma in s["words"] for w in re.findall(r"\w{3,}", lemma)}
        words = re.findall(r"\w+", clause.lower())
        if 5 <= len(words) <= 25 and not name_words & set(words) and '"' not in clause:
            candidates.append((s, clause))
    candidates = [(s, c) for s, c in candidates if clauses[c.lower()] == 1]
    for s, clause in rng.sample(candidates, min(WORDNET_QUESTIONS, len(candidates))):
        article = re.match(r"(a|an|the)\b", clause, re.IGNORECASE)
        described = clause if article else f"the {clause}"
        question = f"Who was {described}?" if s["lex"] == 18 else f"What is the name of {described}?"
        ask("wordnet", question, s["words"], [hop(clause, s["words"][0], s["doc"])])
    return out


# ----------------------------------------------------------------------------------------------
# Filter, split, write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/"), help="where the packages' files are (/ when installed)")
    parser.add_argument("--out", type=Path, default=DATA_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in ("usr/share/wordnet/data.noun", "usr/share/misc/countries.gz", "usr/share/dictd/elements.index"):
        if not (args.root / path).is_file():
            sys.exit(f"{args.root / path} is missing: apt-get install -y {PACKAGES} (or dpkg-deb -x them into --root)")

    rng = random.Random(args.seed)
    docs, countries, currencies, records, synsets, instances = build(args.root)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus_path = args.out / "corpus.jsonl"
    with open(corpus_path, "w", encoding="utf-8") as f:
        for i, contents in enumerate(docs):
            f.write(json.dumps({"id": str(i), "contents": contents}, ensure_ascii=False) + "\n")

    rows = questions(countries, currencies, records, synsets, instances, rng)
    with tempfile.TemporaryDirectory() as cache:
        bm25 = BM25Retriever(Corpus(corpus_path), cache)
        kept = [row for row in rows
                if all(h["doc"] in [d["id"] for d in bm25.search(h["search"], TOP_K)] for h in row["hops"])]
    print(f"{len(docs)} passages; {len(rows)} questions, {len(kept)} kept (every hop's passage in bm25 top {TOP_K})")

    by_category = defaultdict(list)
    for row in kept:
        by_category[row["category"]].append(row)
    test, train = [], []
    for category in sorted(by_category):
        group = by_category[category]
        rng.shuffle(group)
        cut = round(len(group) * TEST_FRACTION)
        test += group[:cut]
        train += group[cut:]
        print(f"  {category:17s} {len(group):5d}  test {cut:4d}  train {len(group) - cut:5d}")
    final = [{**row, "split": "test"} for row in test] + [{**row, "split": "train"} for row in train]
    with open(args.out / "qa.jsonl", "w", encoding="utf-8") as f:
        for r, row in enumerate(final):
            ordered = {"id": EMBEDDED_BASE + r, "question": row["question"], "golden_answers": row["golden_answers"],
                       "split": row["split"], "category": row["category"], "hops": row["hops"]}
            f.write(json.dumps(ordered, ensure_ascii=False) + "\n")
    envs.save_task_ids(args.out.parent / "searchqa_test.json", "searchqa", [EMBEDDED_BASE + r for r in range(len(test))])
    envs.save_task_ids(args.out.parent / "searchqa_train.json", "searchqa",
                       [EMBEDDED_BASE + len(test) + r for r in range(len(train))])
    write_notice(args.root, args.out / "NOTICE.md")
    print(f"wrote {args.out}/corpus.jsonl, qa.jsonl, NOTICE.md and searchqa_{{train,test}}.json "
          f"({len(test)} test, {len(train)} train)")


def write_notice(root: Path, path: Path) -> None:
    sections = [
        "# SearchQA embedded data: sources and licences\n",
        "`corpus.jsonl` and `qa.jsonl` were generated by `scripts/searchqa_build_data.py` from the Debian "
        f"packages {', '.join(f'`{p}`' for p in PACKAGES.split())}. The notices of those packages follow verbatim.\n",
        "- WordNet glosses: every WordNet 3.0 noun synset that has an instance hypernym, as "
        "`lemma, lemma, ...: gloss`. Questions of the `wordnet` and `city-capital` categories use them.\n"
        "- GNU miscfiles (`countries.gz`, `currency.gz`): country names, ISO codes, capitals and currencies, "
        "restated as one sentence per country and per currency.\n"
        "- The Elements database (Jay F. Kominek, public domain): one passage per dictionary entry.\n",
    ]
    for package, what in (("wordnet-base", "WordNet 3.0"), ("miscfiles", "GNU miscfiles"),
                          ("dict-elements", "The Elements database")):
        sections.append(f"\n## {what} (Debian package `{package}`)\n\n```\n{notice(root, package).strip()}\n```\n")
    path.write_text("\n".join(sections), encoding="utf-8")


if __name__ == "__main__":
    main()
