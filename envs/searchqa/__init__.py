"""SearchQA: Search-R1-style deep search, in process, with real retrievers and offline by default.

The agent reasons in <think>, issues <search>query</search> and gets the top documents back as
<information>Doc 1(Title: "...") text ...</information>, and finishes with <answer>...</answer>.
The prompt, first observation, messages, document format and reward are AgentGym's
agentenv-searchqa server and client, verbatim:

- the first complete <search>...</search> or <answer>...</answer> tag in the response decides the
  action; neither gives upstream's "invalid action" message (reward 0, not done);
- search: the top `topk` (upstream: 3) passages of the retriever, reward 0, not done;
- answer: exact match, after Search-R1's normalisation (lowercase, drop punctuation, drop the
  articles a/an/the, collapse whitespace), of the LAST <answer> in the response against any golden
  answer. Right: reward 1, done. Wrong: reward 0 and NOT done, so the agent may try again.

The state key (Env.state_key, GiGPO's anchor groups) is the set of documents retrieved so far, their ids sorted and
joined by "|" ("106|1691|170"; "no documents" at first; a digest past 100 characters). The retriever keeps no state,
so what an action acts on is what the agent has been shown. A set, not a sequence: two searches in the other order,
or a search that only brings back documents already seen, leave the agent knowing the same; the order is history.
Answers are not in it: a wrong one leaves the episode as it was (the question stays open, any answer may follow)
and a right one ends it.

    env = envs.make("searchqa")                                    # embedded corpus + bm25
    env = envs.make("searchqa", corpus_path="wiki-18.jsonl")       # bm25 over any Search-R1 corpus
    env = envs.make("searchqa", retriever="dense", corpus_path="wiki-18.jsonl",
                    index_path="e5_Flat.index", encoder_path="e5-base-v2")
    env = envs.make("searchqa", retriever="remote", retrieval_url="http://gpu-box:8000/retrieve",
                    qa_path="FlashRAG_datasets")                   # AgentGym's real QA ids

Task ids: see envs/searchqa/data.py (AgentGym's global ids for the real sets with qa_path=, and
ids from 1,000,000 for the embedded set that ships in envs/data/searchqa/).

Default data: synthetic. The default questions are the embedded set: 2,144 questions that
scripts/searchqa_build_data.py writes from text Debian packages ship (WordNet glosses, GNU
miscfiles' country and currency tables, the Elements database), answered from an 8,278-passage
corpus of the same text; envs/data/searchqa_{train,test}.json split them 1,715 / 429. None of it
is the paper's data, whose questions are NQ, TriviaQA, PopQA, HotpotQA, 2WikiMultihopQA, MuSiQue
and Bamboogle (AgentGym's ids 0-221,327) searched in wiki-18. To run the paper's sets, give the
real QA sets, a wiki-18 retriever and AgentGym-RL-Data-ID's id files:
`python train.py --env searchqa --env-options qa_path FlashRAG_datasets retriever remote
retrieval_url http://host:8000/retrieve --train-tasks searchqa_train.json`, then `python eval.py
--env searchqa --env-options <the same> --tasks searchqa_test.json`. Eval categories are the
dataset (real ids) or the question template (embedded ids).

Where this port differs from upstream:
- The default data (above) and the default retriever: bm25 (bm25s with pyserini's settings) over
  the small shipped corpus, where upstream's is e5 + FAISS over wiki-18; both of upstream's are
  available (dense, or remote for a Search-R1 server).
- `topk` documents per search is an option (default 3); upstream always returns 3, whatever its
  SEARCHQA_RETRIEVAL_TOPK says.
- Upstream scores an answer with a format-aware scorer first; with its format scores all 0 and no
  chat markers inside a single response that reduces to plain EM, which is what this computes.
- A query with no searchable term (e.g. empty) returns "<information></information>" from bm25,
  as pyserini does; the dense and remote backends return their nearest passages as upstream.
"""

from __future__ import annotations

import copy
import re
import string
import threading
from typing import Callable

from envs import Env, StepResult, canonical_key
from envs.searchqa import data
from envs.searchqa.data import EMBEDDED_BASE, EMBEDDED_CORPUS, RealQA, Task, category  # noqa: F401
from envs.searchqa.retrievers import QUERY_PREFIX, get_retriever
from envs.tools import Param, Tool

INSTRUCTION = (
    "You must always reason inside <think>...</think> first; if you lack knowledge, issue a "
    "<search>...</search> and then stop; do not generate <information> or <answer> yet; wait for external "
    "input between <information>...</information> before continuing; resume only when new <information> "
    "is given; do not skip steps or anticipate answers early."
)
ACK = "Ok."
PROMPT = (
    "You must reason inside <think>...</think> first. If you do not have enough knowledge, issue a "
    "<search>...</search> and then STOP. Do not generate <information> or <answer> yet. Wait for external "
    "input wrapped in <information>...</information>. After receiving information, reason again in <think>. "
    "If confident, output your final answer in <answer>...</answer>. Do not output <answer> before receiving "
    "<information> unless you are fully confident. If you find no further external knowledge needed, you can "
    "directly provide the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Follow this process every time.\n\n Question: {question}"
)
CORRECT = "Congratulations! You have answered the question correctly."
WRONG = "Sorry, your answer is incorrect. Please try again."
INVALID = (
    "Your previous action is invalid. If you want to search, you should put the query between <search> and "
    "</search>. If you want to give the final answer, you should put the answer between <answer> and </answer>. "
    "Please try again."
)
TAGS = ("search", "answer")
PUNCTUATION = set(string.punctuation)

# The two actions as native tools (envs/tools.py), each call the tag a reply would write.
TOOLS = (
    Tool("search", "Search for documents.", {"query": Param("string", "What to search for")},
         "<search>{query}</search>"),
    Tool("answer", "Give the final answer.", {"answer": Param("string", "The answer, in a few words")},
         "<answer>{answer}</answer>"),
)
REPLY = "{action}"


def parse_action(text: str) -> tuple[str, str] | None:
    """The first complete <search>...</search> or <answer>...</answer> of a response, as upstream's
    `re.search(r"<(search|answer)>(.*?)</\1>", text, re.DOTALL)` finds it: the leftmost opening tag
    with a closing tag of its kind somewhere after it, up to the first such closing tag. In linear
    time: the regex retries every opening tag and scans to the end for each (quadratic: 30 s on
    "<search>" * 20000)."""
    best = None
    for tag in TAGS:
        start = text.find(f"<{tag}>")
        # only the first opening tag of a kind can match: a later one has fewer closing tags after it
        if start != -1 and text.rfind(f"</{tag}>") >= start + len(tag) + 2 and (best is None or start < best[1]):
            best = (tag, start)
    if best is None:
        return None
    tag, start = best
    begin = start + len(tag) + 2
    return tag, text[begin:text.find(f"</{tag}>", begin)]


def read_action(text: str) -> str | None:
    """The action a reply sends, as step() reads it: the first complete tag, and for an answer the last
    <answer> of the reply, stripped."""
    parsed = parse_action(text)
    if parsed is None:
        return None
    tag, content = parsed
    return f"<{tag}>{(content if tag == 'search' else last_answer(text)).strip()}</{tag}>"


def last_answer(text: str) -> str | None:
    """The content of the last <answer>...</answer>, as the last of upstream's
    `re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)`, in linear time."""
    answer, position = None, 0
    while (start := text.find("<answer>", position)) != -1:
        end = text.find("</answer>", start + 8)
        if end == -1:
            break
        answer, position = text[start + 8:end], end + 9
    return answer


def normalize_answer(text: str) -> str:
    """Search-R1's (SQuAD's) normalisation: lowercase, drop punctuation, drop articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golden_answers: list[str] | str) -> bool:
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    prediction = normalize_answer(prediction)
    return any(normalize_answer(answer) == prediction for answer in golden_answers)


def format_docs(docs: list[dict]) -> str:
    """Upstream's _passages2string: the first line of `contents` is the (quoted) title."""
    text = ""
    for i, doc in enumerate(docs):
        title, _, body = doc["contents"].partition("\n")
        text += f"Doc {i + 1}(Title: {title}) {body}\n"
    return text


class SearchQA(Env):
    name = "searchqa"
    instruction = INSTRUCTION
    ack = ACK

    def __init__(self, retriever, real_qa: RealQA | None, topk: int):
        self.retriever = retriever
        self.real_qa = real_qa
        self.topk = topk
        self.task: Task | None = None
        self.retrieved: set[str] = set()  # ids of the documents shown so far (the state key)

    def reset(self, task_id: int) -> str:
        task_id = int(task_id)
        if task_id >= EMBEDDED_BASE:
            self.task = data.embedded_task(task_id)
        elif self.real_qa is None:
            split, dataset, _, _ = data._range_of(task_id)
            raise ValueError(f"searchqa task {task_id} is a {dataset} {split} question of AgentGym's real QA sets; "
                             "pass qa_path= the FlashRAG_datasets folder")
        else:
            self.task = self.real_qa.task(task_id)
        self.task_id, self.retrieved = task_id, set()
        return PROMPT.format(question=self.task.question)

    def state_key(self) -> str | None:
        """The documents retrieved so far (see the module docstring); None before the first reset."""
        if self.task is None:
            return None
        return canonical_key("|".join(sorted(self.retrieved)) or "no documents")

    def fork(self) -> SearchQA:
        """An independent copy (Env.fork): its own retrieved documents; the retriever and the QA sets, which no call
        changes, are shared (as every instance of one corpus shares them)."""
        twin = copy.copy(self)
        twin.retrieved = set(self.retrieved)
        return twin

    def step(self, text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("call reset(task_id) before step()")
        parsed = parse_action(text)
        if parsed is None:
            return StepResult(INVALID, 0.0, False, {"action": None, "valid": False})
        action, content = parsed[0], parsed[1].strip()
        if action == "search":
            docs = self.retriever.search(content, self.topk)
            info = {"action": "search", "valid": True, "query": content, "doc_ids": [doc.get("id") for doc in docs]}
            # a passage without an id (a remote retriever need not send one) is known by its text
            self.retrieved.update(str(doc["id"]) if doc.get("id") is not None else canonical_key(doc["contents"])
                                  for doc in docs)
            return StepResult(f"<information>{format_docs(docs).strip()}</information>", 0.0, False, info)
        answer = last_answer(text).strip()  # upstream scores the last <answer> of the response
        correct = exact_match(answer, self.task.golden_answers)
        info = {"action": "answer", "valid": True, "answer": answer, "success": correct}
        return StepResult(CORRECT if correct else WRONG, float(correct), correct, info)


def make(retriever: str = "bm25", corpus_path: str | None = None, index_path: str | None = None,
         encoder_path: str | None = None, retrieval_url: str | None = None, qa_path: str | None = None,
         topk: int = 3, cache_dir: str | None = None, query_prefix: str = QUERY_PREFIX,
         timeout: float = 60.0) -> SearchQA:
    """retriever: bm25 (default), dense or remote. corpus_path: a Search-R1 jsonl corpus (default: the
    shipped one; dense needs it too). index_path/encoder_path: the dense FAISS index and local encoder
    folder. retrieval_url: a Search-R1 retrieval server. qa_path: folder of the real QA sets, for
    AgentGym's global ids. topk: documents per search (upstream: 3). cache_dir: where bm25 indexes are
    cached (default ~/.cache/agentgym-rl/searchqa)."""
    if retriever in ("bm25", "dense") and corpus_path is None:
        if retriever == "dense":
            raise ValueError("retriever=dense needs corpus_path=, index_path= and encoder_path=")
        corpus_path = EMBEDDED_CORPUS
    backend = get_retriever(retriever, corpus_path=corpus_path, index_path=index_path, encoder_path=encoder_path,
                            retrieval_url=retrieval_url, cache_dir=cache_dir, query_prefix=query_prefix,
                            timeout=float(timeout))
    if int(topk) < 1:
        raise ValueError(f"topk must be at least 1, got {topk}")
    real_qa = _real_qa(qa_path) if qa_path else None
    return SearchQA(backend, real_qa, int(topk))


_REAL_QA: dict[str, RealQA] = {}
_LOCK = threading.Lock()


def _real_qa(qa_path: str) -> RealQA:
    """One RealQA per folder, so env instances share the loaded files."""
    with _LOCK:
        if str(qa_path) not in _REAL_QA:
            _REAL_QA[str(qa_path)] = RealQA(qa_path)
        return _REAL_QA[str(qa_path)]


def oracle(env: SearchQA) -> Callable[[str], str]:
    """A scripted expert that knows the answer: it makes the task's searches (the embedded set's
    recorded hops; for the real sets, the question itself), one per turn, then answers with the first
    golden answer. Its text follows the prompt's format, so transcripts can serve as SFT data."""
    task = env.task
    hops = list(task.hops) or [{"search": task.question.rstrip("?"), "find": ""}]
    answer = task.golden_answers[0]
    turn = 0

    def act(observation: str) -> str:
        nonlocal turn
        turn += 1
        if turn <= len(hops):
            query = hops[turn - 1]["search"]
            found = hops[turn - 2].get("find") if turn > 1 else ""
            seen = f"The information mentions {found}. " if found else ""
            return f"<think>{seen}I need to search for: {query}.</think>\n<search> {query} </search>"
        return f"<think>The information says the answer is {answer}.</think>\n<answer> {answer} </answer>"

    return act
