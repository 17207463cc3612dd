"""HotpotQA as a search-agent task: data, corpus, retrievers, the ``search`` tool and the Search-R1 prompt.

The TreeOPSD paper (Appendix E.1.1 / F.1) trains on HotpotQA's distractor training split; the agent calls a search
tool that returns the top three passages of a retrieval index, and answers inside ``<answer>...</answer>``. This
module provides each piece so that the same code runs on the Hub dataset, on local copies of it, and on the offline
synthetic world of :mod:`trl_tree.envs.synthetic`:

- loading: :func:`load_hotpot_examples` / :func:`load_hotpot_dataset` (Hub id or local JSON / JSONL / parquet, in
  either of HotpotQA's two layouts), normalised to one internal form;
- corpus: :func:`build_corpus` (the distractor paragraphs) or :func:`load_corpus` (a JSONL dump);
- retrievers sharing one protocol: :class:`BM25Retriever` (default, cached on disk), :class:`DenseRetriever` (E5 with
  sentence-transformers) and :class:`RemoteRetriever` (a Search-R1 retrieval server);
- the tool: :func:`make_search_tool` for TRL's ``tools=`` and :class:`SearchEnv` for ``environment_factory``;
- the prompt: :func:`build_prompt`.

Internal example form (the ``datasets`` layout of HotpotQA)::

    {"id": str, "question": str, "answer": str | list[str], "type": str, "level": str,
     "supporting_facts": {"title": [str, ...], "sent_id": [int, ...]},
     "context": {"title": [str, ...], "sentences": [[str, ...], ...]}}
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from ..rollout.acting.tools import MAX_OBSERVATION_CHARS, ToolFatalError, batched_tool
from ..text import shorten

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("question", "answer")
SEARCH_TOOL_NAME = "search"
DEFAULT_TOPK = 3
DEFAULT_MAX_QUERY_CHARS = 512  # the paper's query limit (Appendix F.1)
DEFAULT_MAX_CHARS = MAX_OBSERVATION_CHARS  # the paper's cap on retrieved observations
DEFAULT_MAX_BATCH_SIZE = 256  # searches per batched request (under the retrieval server's --max_queries, 1024)
# The search tool cuts its passage list so that list and marker fit in `max_chars` together; what the model then sees
# of any tool output is cut again at `max_observation_chars` with `rollout.tools.TRUNCATION_MARKER` (the same 16,384 by
# default, so a search observation is never cut twice).
TRUNCATION_MARKER = "\n[... search results truncated]"
_LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")

# ---------------------------------------------------------------------------------------------------------------
# Prompt (Search-R1 instruction, adapted to native tool calls)
# ---------------------------------------------------------------------------------------------------------------

SYSTEM_PROMPT = "You are a helpful assistant that answers questions by searching for the knowledge you lack."

# Search-R1's instruction with its `<search>`/`<information>` tags replaced by the search tool: the chat template
# renders the tool schema and the tool-call format, and thinking models wrap their reasoning themselves.
USER_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call the search tool with a query "
    "and it will return the top searched results. You can search as many times as you want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)


def build_prompt(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """The conversational prompt: a system message and the Search-R1 instruction followed by the question.

    The tool schema is not written here: the trainer renders the chat template with ``tools=``, which appends it to
    the system turn (paper, Appendix F.1). Pass ``system_prompt=None`` to leave the system turn to the template.
    """
    user = {"role": "user", "content": USER_INSTRUCTION.format(question=question.strip())}
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [user]


# ---------------------------------------------------------------------------------------------------------------
# Loading HotpotQA
# ---------------------------------------------------------------------------------------------------------------


def _check_columns(columns: Iterable[str], source: str) -> None:
    """Fail early, naming what is missing and what is there, when the question or answer column is absent."""
    columns = list(columns)
    missing = [name for name in REQUIRED_COLUMNS if name not in columns]
    if missing:
        raise ValueError(
            f"HotpotQA data from {source} is missing the column(s) {missing}; found columns {sorted(columns)}."
        )


def _normalize_context(context: Any) -> dict[str, list]:
    """``context`` as ``{"title": [...], "sentences": [[...], ...]}`` from either layout.

    The original JSON release stores ``[[title, [sentence, ...]], ...]``; the ``datasets`` release stores the dict.
    """
    if not context:
        return {"title": [], "sentences": []}
    if isinstance(context, dict):
        return {"title": list(context["title"]), "sentences": [list(s) for s in context["sentences"]]}
    return {"title": [title for title, _ in context], "sentences": [list(sentences) for _, sentences in context]}


def _normalize_supporting_facts(facts: Any) -> dict[str, list]:
    """``supporting_facts`` as ``{"title": [...], "sent_id": [...]}`` from either layout (original: pairs)."""
    if not facts:
        return {"title": [], "sent_id": []}
    if isinstance(facts, dict):
        return {"title": list(facts["title"]), "sent_id": [int(i) for i in facts["sent_id"]]}
    return {"title": [title for title, _ in facts], "sent_id": [int(sent_id) for _, sent_id in facts]}


def normalize_example(record: dict[str, Any], index: int = 0, source: str = "records") -> dict[str, Any]:
    """One HotpotQA record, in either layout, in the internal form (see the module docstring).

    The original release names the id ``_id``; a record without an id gets its position.
    """
    _check_columns(record.keys(), f"{source} (row {index})")
    answer = record["answer"]
    return {
        "id": str(record.get("id", record.get("_id", index))),
        "question": record["question"],
        "answer": answer if isinstance(answer, str) else list(answer),
        "type": record.get("type") or "",
        "level": record.get("level") or "",
        "supporting_facts": _normalize_supporting_facts(record.get("supporting_facts")),
        "context": _normalize_context(record.get("context")),
    }


def normalize_examples(records: Iterable[dict[str, Any]], source: str = "records") -> list[dict[str, Any]]:
    """Every record of ``records`` in the internal form."""
    return [normalize_example(record, i, source) for i, record in enumerate(records)]


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each non-blank line; a line that is not JSON names the file and line."""
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {line_number}: not valid JSON ({e.msg}).") from e


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The raw records of one local file (JSON list, JSONL, or parquet)."""
    if path.suffix == ".jsonl":
        return [record for _, record in _read_jsonl(path)]
    if path.suffix == ".json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of HotpotQA records, got {type(data).__name__}.")
        return data
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        # Parquet can only hold the `datasets` layout: the original layout's [title, [sentences]] pairs mix types.
        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {_LOCAL_SUFFIXES}.")


def _local_files(path: Path, config: str, split: str) -> list[Path]:
    """The data files of ``path``: the file itself, or in a directory the files of ``split``.

    A directory is read like a local copy of the Hub repository (``distractor/train-00000-of-00002.parquet``): files
    under ``<path>/<config>`` when that folder exists, else under ``<path>``, whose names start with the split.
    """
    if path.is_file():
        return [path]
    folder = path / config if (path / config).is_dir() else path
    files = sorted(p for p in folder.iterdir() if p.name.startswith(split) and p.suffix in _LOCAL_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"No {split!r} files ({', '.join(_LOCAL_SUFFIXES)}) in {folder}.")
    return files


def _load_hub(name: str, config: str, split: str) -> list[dict[str, Any]]:
    """Rows of a Hub dataset (e.g. ``hotpotqa/hotpot_qa``, configs ``distractor`` / ``fullwiki``)."""
    import datasets

    dataset = datasets.load_dataset(name, config, split=split)
    _check_columns(dataset.column_names, f"{name} ({config}, {split})")
    return list(dataset)


def load_hotpot_examples(
    name_or_path: str | os.PathLike = "hotpotqa/hotpot_qa", config: str = "distractor", split: str = "train"
) -> list[dict[str, Any]]:
    """HotpotQA examples in the internal form, from a local file or folder when the path exists, else the Hub.

    Local files may be JSON (a list of records), JSONL or parquet, in the original layout (``context`` as
    ``[title, sentences]`` pairs, ``supporting_facts`` as ``[title, sent_id]`` pairs, ``_id``) or the ``datasets``
    layout (dicts of lists). ``config`` and ``split`` select the files of a local folder or the Hub configuration.
    """
    path = Path(name_or_path)
    if not path.exists():
        return normalize_examples(_load_hub(str(name_or_path), config, split), source=str(name_or_path))
    examples = []
    for file in _local_files(path, config, split):
        examples += normalize_examples(_read_records(file), source=str(file))
    return examples


def load_hotpot_dataset(
    name_or_path: str | os.PathLike = "hotpotqa/hotpot_qa",
    config: str = "distractor",
    split: str = "train",
    system_prompt: str | None = SYSTEM_PROMPT,
    limit: int | None = None,
):
    """A ``datasets.Dataset`` with ``prompt`` (conversational), ``question``, ``answer`` and ``id`` columns.

    Ready for GRPOTrainer-style trainers: ``prompt`` is what the policy sees, ``answer`` feeds the rewards of
    :mod:`trl_tree.rewards`. ``limit`` keeps the first examples (for quick runs).
    """
    examples = load_hotpot_examples(name_or_path, config, split)
    return examples_to_dataset(examples[:limit] if limit is not None else examples, system_prompt)


def examples_to_dataset(examples: list[dict[str, Any]], system_prompt: str | None = SYSTEM_PROMPT):
    """Internal-form examples (real or synthetic) as a trainer dataset: ``prompt``, ``question``, ``answer``, ``id``."""
    import datasets

    rows = [
        {
            "prompt": build_prompt(example["question"], system_prompt),
            "question": example["question"],
            "answer": example["answer"],
            "id": example["id"],
        }
        for example in examples
    ]
    return datasets.Dataset.from_list(rows)


# ---------------------------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------------------------


def build_corpus(examples: Iterable[dict[str, Any]]) -> list[dict[str, str]]:
    """The distractor-setting corpus: every context paragraph once (first occurrence of a title wins).

    HotpotQA paragraphs are Wikipedia introductions, so a title identifies its paragraph; a paragraph appears in the
    contexts of many questions and must be indexed once or it would crowd the top-k with copies.
    """
    corpus, seen = [], set()
    for example in examples:
        context = _normalize_context(example.get("context"))
        for title, sentences in zip(context["title"], context["sentences"]):
            if title in seen:
                continue
            seen.add(title)
            corpus.append({"id": str(len(corpus)), "title": title, "text": " ".join(s.strip() for s in sentences)})
    return corpus


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1's ``contents`` field (``"Title"\\ntext``) as (title, text); no newline means no title."""
    title, newline, text = contents.partition("\n")
    if not newline:
        return "", contents.strip()
    return title.strip().strip('"'), text.strip()


def _corpus_entry(record: Any, fallback_id: str) -> dict[str, str]:
    """A corpus record in either supported format as ``{"id", "title", "text"}``; KeyError/TypeError otherwise."""
    if "contents" in record:
        title, text = split_contents(record["contents"])
    else:
        title, text = record["title"], record["text"]
    if not isinstance(title, str) or not isinstance(text, str):
        raise TypeError("title and text must be strings")
    return {"id": str(record.get("id", fallback_id)), "title": title, "text": text}


def load_corpus(path: str | os.PathLike) -> list[dict[str, str]]:
    """A JSONL corpus: lines of ``{"id", "title", "text"}`` or Search-R1's ``{"id", "contents": "\\"Title\\"\\ntext"}``.

    A line that is not JSON, or lacks both formats' fields, raises ValueError with the file and line number, since
    a silently skipped passage would only show up much later as a question nobody can answer.
    """
    path = Path(path)
    corpus = []
    for line_number, record in _read_jsonl(path):
        try:
            corpus.append(_corpus_entry(record, fallback_id=str(len(corpus))))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{path}, line {line_number}: expected {{'id', 'title', 'text'}} or {{'id', 'contents'}}, got "
                f"{str(record)[:200]}."
            ) from e
    return corpus


def _document_text(doc: dict[str, str]) -> str:
    """What a retriever indexes for a passage: the title matters as much as the text for entity queries."""
    return f"{doc['title']}\n{doc['text']}" if doc.get("title") else doc["text"]


def _hit(doc: dict[str, str], score: float) -> dict[str, Any]:
    return {"id": doc.get("id", ""), "title": doc.get("title", ""), "text": doc["text"], "score": float(score)}


# ---------------------------------------------------------------------------------------------------------------
# Retrievers
# ---------------------------------------------------------------------------------------------------------------


class Retriever(Protocol):
    """Anything that returns, for each query, its top-k passages as ``{"title", "text", "score"}`` dicts (best first).

    One ``search`` call takes many queries (the search tool's batched form sends a round's searches together). The
    trainer may call it from several threads at once; a retriever that is safe for that says so with a class
    attribute ``thread_safe = True`` (the retrieval server serializes the searches of one that does not)."""

    def search(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]: ...


def default_cache_dir() -> Path:
    """Where indexes are cached: ``$TRL_TREE_CACHE``, else ``$XDG_CACHE_HOME/trl_tree``, else ``~/.cache/trl_tree``."""
    if "TRL_TREE_CACHE" in os.environ:
        return Path(os.environ["TRL_TREE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trl_tree"


def _fingerprint(corpus: list[dict[str, str]], settings: dict[str, Any]) -> str:
    """A hash of the corpus contents and the index settings: the same corpus indexed the same way shares a cache."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for doc in corpus:
        digest.update(json.dumps([doc.get("id", ""), doc.get("title", ""), doc["text"]]).encode())
    return digest.hexdigest()[:24]


def _load_stemmer(language: str | None):
    """A PyStemmer stemmer for ``language``, or None."""
    if language is None:
        return None
    try:
        import Stemmer
    except ImportError as e:
        raise ImportError("BM25 stemming needs PyStemmer: `pip install PyStemmer`, or pass stemmer=None.") from e
    return Stemmer.Stemmer(language)


class BM25Retriever:
    """Sparse BM25 retrieval with ``bm25s`` over an in-memory corpus, with the index cached on disk.

    Building a BM25 index over a large corpus takes minutes, and every process of a multi-GPU run builds the same one,
    so the index is saved under ``cache_dir`` keyed by a hash of the corpus and settings, and loaded when the same
    corpus is indexed again (``self.from_cache`` tells which happened). The cache is written to a temporary folder
    and renamed into place, so concurrent builders never read a half-written index.

    Args:
        corpus: passages as ``{"id", "title", "text"}`` dicts; the title is indexed with the text.
        cache_dir: where to cache the index (default :func:`default_cache_dir` ``/ "bm25"``).
        use_cache: set False to always rebuild and never write.
        stopwords: a ``bm25s`` stopword list name (``"en"``) or None.
        stemmer: a PyStemmer language (``"english"``) or None.
        k1, b: BM25 parameters.

    ``search`` may be called from many threads at once (the trainer's concurrent tool calls, the retrieval server's
    worker threads): scoring only reads the index, and the one shared mutable object, PyStemmer's stemmer (not
    thread-safe), is used under a lock. A deep copy is the retriever itself: the index is read-only.
    """

    thread_safe = True  # `search` may run in several threads at once (the retrieval server needs no lock for it)

    def __init__(
        self,
        corpus: list[dict[str, str]],
        cache_dir: str | os.PathLike | None = None,
        use_cache: bool = True,
        stopwords: str | None = "en",
        stemmer: str | None = None,
        k1: float = 1.5,
        b: float = 0.75,
    ):
        import bm25s

        if not corpus:
            raise ValueError("BM25Retriever needs a non-empty corpus.")
        self.corpus = corpus
        self._stopwords = stopwords
        self._stemmer = _load_stemmer(stemmer)
        self._stemmer_lock = threading.Lock()
        settings = {"stopwords": stopwords, "stemmer": stemmer, "k1": k1, "b": b, "bm25s": bm25s.__version__}
        self.cache_path = Path(cache_dir or default_cache_dir() / "bm25") / f"bm25-{_fingerprint(corpus, settings)}"
        self.from_cache = use_cache and self.cache_path.is_dir()
        if self.from_cache:
            self._index = bm25s.BM25.load(str(self.cache_path), load_vocab=True, show_progress=False)
        else:
            self._index = self._build(k1, b)
            if use_cache:
                self._save()

    def __deepcopy__(self, memo: dict) -> BM25Retriever:
        return self

    def _tokenize(self, texts: list[str], return_ids: bool):
        import bm25s

        def tokenize():
            return bm25s.tokenize(
                texts, stopwords=self._stopwords, stemmer=self._stemmer, return_ids=return_ids, show_progress=False
            )

        if self._stemmer is None:
            return tokenize()
        with self._stemmer_lock:
            return tokenize()

    def _build(self, k1: float, b: float):
        import bm25s

        index = bm25s.BM25(k1=k1, b=b)
        index.index(self._tokenize([_document_text(doc) for doc in self.corpus], return_ids=True), show_progress=False)
        return index

    def _save(self) -> None:
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=self.cache_path.parent, prefix=".staging-"))
        self._index.save(str(staging), show_progress=False)
        try:
            staging.rename(self.cache_path)
        except OSError:  # another process finished first: its index is identical
            shutil.rmtree(staging, ignore_errors=True)

    def search(self, queries: list[str], topk: int = DEFAULT_TOPK) -> list[list[dict[str, Any]]]:
        """Top-``topk`` passages per query, ties broken by corpus order; passages sharing no term with the query
        (score 0) are left out.

        ``bm25s.BM25.retrieve`` breaks ties in whatever order ``numpy.argpartition`` leaves them, which depends on
        the CPU (its AVX-512 path orders equal keys differently) and the NumPy release: on templated corpora most
        queries tie at the top-k boundary, so the same corpus and query gave different observations, and different
        warm starts, on different machines. The scores are bm25s's; only the selection is ours."""
        k = min(topk, len(self.corpus))
        hits = []
        for tokens in self._tokenize(queries, return_ids=False):
            scores = self._index.get_scores(tokens) if tokens else np.zeros(len(self.corpus), dtype=np.float32)
            hits.append([_hit(self.corpus[i], scores[i]) for i in top_k_by_score(scores, k) if scores[i] > 0])
        return hits


def top_k_by_score(scores: np.ndarray, k: int) -> list[int]:
    """Indices of the ``k`` highest scores, highest first, equal scores in index order: the same answer on every
    machine, whatever order a partition leaves ties in. O(n): a partition finds the k-th score (a value, which does not
    depend on tie order), then only the scores at or above it are sorted."""
    if k <= 0 or len(scores) == 0:
        return []
    k = min(k, len(scores))
    kth = np.partition(scores, len(scores) - k)[len(scores) - k]
    candidates = np.flatnonzero(scores >= kth)
    order = np.lexsort((candidates, -scores[candidates]))  # last key first: score descending, then index
    return candidates[order][:k].tolist()


def _load_sentence_transformer(model_name: str, device: str | None):
    """sentence-transformers is optional; say how to get it instead of failing on a bare import."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise ImportError(
            "DenseRetriever needs sentence-transformers, an optional dependency: `pip install trl-tree[dense]`."
        ) from e
    return SentenceTransformer(model_name, device=device)


class DenseRetriever:
    """Dense retrieval with an E5-style encoder (the paper's retriever): cosine similarity over normalised embeddings.

    E5 was trained with ``query: `` and ``passage: `` prefixes and retrieves noticeably worse without them. The
    encoder is anything with ``encode(texts, batch_size=...) -> array``: by default a sentence-transformers model
    loaded lazily; tests inject a fake. Passage embeddings are computed once at construction.

    Args:
        corpus: passages as ``{"id", "title", "text"}`` dicts.
        model_name: the sentence-transformers model (default ``intfloat/e5-base-v2``, as Search-R1).
        encoder: an already-built encoder; ``model_name`` is then ignored.
        batch_size: encoding batch size. device: where to run the default encoder.

    Searches from several threads take turns (a lock around the encoder): an encoder is not known to be thread-safe,
    and concurrent encodes on one device only contend for it. A deep copy is the retriever itself.
    """

    thread_safe = True  # through its lock

    def __init__(
        self,
        corpus: list[dict[str, str]],
        model_name: str = "intfloat/e5-base-v2",
        encoder: Any = None,
        batch_size: int = 64,
        device: str | None = None,
        query_prefix: str = "query: ",
        passage_prefix: str = "passage: ",
    ):
        if not corpus:
            raise ValueError("DenseRetriever needs a non-empty corpus.")
        self.corpus = corpus
        self.encoder = encoder if encoder is not None else _load_sentence_transformer(model_name, device)
        self.batch_size = batch_size
        self.query_prefix, self.passage_prefix = query_prefix, passage_prefix
        self._lock = threading.Lock()
        self._embeddings = self._encode([passage_prefix + _document_text(doc) for doc in corpus])

    def __deepcopy__(self, memo: dict) -> DenseRetriever:
        return self

    def _encode(self, texts: list[str]):
        import numpy as np

        vectors = np.asarray(self.encoder.encode(texts, batch_size=self.batch_size), dtype=np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.maximum(norms, 1e-12)

    def search(self, queries: list[str], topk: int = DEFAULT_TOPK) -> list[list[dict[str, Any]]]:
        """Top-``topk`` passages per query by cosine similarity (ties in corpus order, as BM25's)."""
        with self._lock:
            scores = self._encode([self.query_prefix + q for q in queries]) @ self._embeddings.T
        k = min(topk, len(self.corpus))
        return [[_hit(self.corpus[i], row[i]) for i in top_k_by_score(row, k)] for row in scores]


def _parse_remote_hit(entry: dict[str, Any]) -> dict[str, Any]:
    """A Search-R1 server result entry (``{"document": {...}, "score"}`` or a bare document) as a hit.

    A document with ``title`` and ``text`` (``trl-tree retrieval-server`` sends them beside ``contents``) is read from
    them: ``contents`` (``"Title"\ntext``) cannot carry a title that contains a quote or a newline exactly. An entry of
    another shape raises TypeError or KeyError (`RemoteRetriever._parse` names the server and the API)."""
    if not isinstance(entry, dict):
        raise TypeError(f"a passage is a {type(entry).__name__}, not an object")
    doc = entry.get("document", entry)
    if not isinstance(doc, dict):
        raise TypeError(f"a passage's 'document' is a {type(doc).__name__}, not an object")
    if "text" in doc and "title" in doc:
        title, text = doc["title"], doc["text"]
    elif "contents" in doc:
        title, text = split_contents(doc["contents"])
    elif "text" in doc:
        title, text = doc.get("title", ""), doc["text"]
    else:
        raise KeyError(f"a passage has neither 'contents' nor 'text' (its keys: {sorted(doc)})")
    if not isinstance(text, str) or not isinstance(title, str):
        raise TypeError("a passage's title and text must be strings")
    return _hit({"id": str(doc.get("id", "")), "title": title, "text": text}, entry.get("score", 0.0))


def _describe_http_error(error: BaseException | None) -> str:
    """An HTTP failure in words: httpx's exceptions often have an empty message (a read timeout), so name the type;
    an error status comes with the server's own reason (its body)."""
    text = str(error) if error is not None else ""
    response = getattr(error, "response", None)  # httpx.HTTPStatusError
    if response is not None and response.text:
        text += f": {response.text[:300]}"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


SEARCH_R1_SERVER_HELP = (
    "Start one there: `trl-tree retrieval-server --synthetic --port PORT` (the offline example's world, what "
    "`examples/train_hotpot.py` trains on by default), `trl-tree retrieval-server --corpus_path CORPUS.jsonl --port "
    "PORT` (BM25 over your JSONL corpus), or Search-R1's (from the Search-R1 repository: `python "
    "search_r1/search/retrieval_server.py --index_path e5_Flat.index --corpus_path wiki-18.jsonl --topk 3 "
    "--retriever_name e5 --retriever_model intfloat/e5-base-v2`, which serves POST /retrieve on port 8000), and wait "
    "until it has loaded its index"
)
SEARCH_R1_RESPONSE = (
    'JSON {"result": [row, ...]} with one row per query, in order, a row a list of passages {"document": {"id", '
    '"contents"}, "score"} or bare documents {"id", "contents"}'
)
DEFAULT_MAX_CONSECUTIVE_FAILURES = 3  # failed requests in a row that stop the run (see RemoteRetriever)


class RetrievalAPIError(ValueError):
    """A retrieval server answered, but not with Search-R1's API (HTML, another JSON shape, a row per query missing).
    Not retried: an answer of the wrong shape comes back the same the next time."""


class RemoteRetriever:
    """Client of a Search-R1 compatible retrieval server (``POST {url}/retrieve``), such as
    ``trl-tree retrieval-server`` (:mod:`trl_tree.envs.retrieval_server`) or Search-R1's own.

    The request is ``{"queries": [...], "topk": k, "return_scores": true}`` and the response
    ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``; an answer of another shape (HTML, other
    JSON, a row count that is not the query count) raises :class:`RetrievalAPIError` naming the server and what
    Search-R1's API answers. Every request has a timeout and failed connections, timeouts and 5xx answers are retried
    a bounded number of times with exponential backoff, so one search fails with a ``ConnectionError`` after at most
    about ``(max_retries + 1) * timeout + backoff * 2**max_retries`` seconds instead of hanging a rollout forever.
    ``deadline`` (the script passes the trainer's ``tool_timeout``) bounds a search, its retries and pauses included:
    once it has passed, the caller has stopped waiting (the tool call is already answered "timed out"), so the search
    raises TimeoutError instead of retrying on against a slow server in a thread nobody waits for. The search tool's
    caller turns these errors into the model's observation, so a slow query or a brief hiccup does not end a run.

    Requests go through one ``httpx.Client`` whose pool keeps up to ``max_connections`` connections alive: searches
    made concurrently (the trainer's tool workers) each take a pooled connection instead of opening a TCP connection
    per search, and the client is safe to share between threads. Its idle connections are dropped after
    ``KEEPALIVE_EXPIRY`` seconds, before a uvicorn server (5 s by default, as Search-R1's) closes them, so a search
    never goes out on a connection the server is closing. A process that forks gets a client of its own.

    A server that stops answering ends the run: the search that finds it gone raises
    :class:`~trl_tree.rollout.tools.ToolFatalError` naming the server, which stops training instead of letting it
    train on rollouts whose every search returned an error, and every later search raises it too, at once (the
    breaker stays open: a search abandoned at its deadline may be the one that trips it, and its error reaches no
    one). Two rules trip the breaker:

    - ``max_consecutive_failures`` (3) failed requests in a row, whatever came before: each has already been retried
      ``max_retries`` times (a refused connection for about ``backoff * (2**max_retries - 1)`` = 3.5 s by default), so
      three with no answer between them mean a server that failed every attempt for seconds to minutes, not a slow
      query. A tree's rollout makes a search request per round of its turn loop, several per generation, so a server
      that dies stops the run in the generation it died in, before training on it (a generation with fewer search
      rounds than that trains once on error observations first). ``None`` turns this rule off;
    - more than ``max_failure_rate`` of the last ``window`` searches failed (counted once ``min_calls`` searches were
      made): a server that fails most searches while answering some, whose occasional answer resets the count of the
      first rule. Searches, not requests, are counted: a batched request of 200 queries that the server answered is
      200 answered searches, and a failed one 200 failed searches, so a window measures the same share of searches
      whatever the batching. ``max_failure_rate=1.0`` turns this rule off.

    Sporadic failures (a timed-out request among successes) trip neither: each is an error observation for the model,
    and the first failure of an episode (failures until the window holds none again) is logged as a warning, once, so
    a degrading server shows in the log before it stops the run. Every search of the run counts, from any thread:
    copies of the retriever share it and its record.

    ``server``: the child process serving ``url`` when this run started it (a
    :class:`~trl_tree.envs.retrieval_server.RetrievalServerProcess`, or anything whose ``exit_error()`` returns None
    while it runs and why it is gone after): every search polls it first and after a failed attempt, so a server that
    exits stops the run at the next search, naming its exit code and log, without waiting for retries to fail.

    :meth:`check` makes one request, to fail at start-up rather than in the first rollout.
    """

    KEEPALIVE_EXPIRY = 4.0  # seconds an idle pooled connection is kept: under uvicorn's default keep-alive of 5 s
    thread_safe = True  # see `BM25Retriever.thread_safe`

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        timeout: float = 30.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_failure_rate: float = 0.5,
        min_calls: int = 20,
        window: int = 1000,
        max_connections: int = 64,
        max_consecutive_failures: int | None = DEFAULT_MAX_CONSECUTIVE_FAILURES,
        deadline: float | None = None,
        server: Any = None,
    ):
        if not 0.0 <= max_failure_rate <= 1.0:
            raise ValueError(
                f"max_failure_rate is a fraction of searches in [0, 1] (1: never stop); got {max_failure_rate}."
            )
        if not 1 <= min_calls <= window:
            raise ValueError(
                f"RemoteRetriever needs 1 <= min_calls <= window (the breaker judges at least min_calls of the last "
                f"window searches); got min_calls={min_calls}, window={window}."
            )
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1; got {max_connections}.")
        if max_consecutive_failures is not None and (
            isinstance(max_consecutive_failures, bool)
            or not isinstance(max_consecutive_failures, int)
            or max_consecutive_failures < 1
        ):
            raise ValueError(
                f"max_consecutive_failures is a number of failed requests in a row that stops the run (at "
                f"least 1), or None to never stop for it; got {max_consecutive_failures!r}."
            )
        if deadline is not None and not (isinstance(deadline, (int, float)) and 0 < deadline < float("inf")):
            raise ValueError(
                f"deadline is the seconds a search may take, retries included (positive, finite), or "
                f"None for no deadline; got {deadline!r}."
            )
        try:
            import httpx  # noqa: F401 - here, not at the first search, whose ImportError would read as a failed search
        except ImportError as e:
            raise ImportError(
                "RemoteRetriever needs httpx: `pip install trl-tree[retrieval]` (or `pip install httpx`)."
            ) from e
        self.endpoint = url.rstrip("/") + ("" if url.rstrip("/").endswith("/retrieve") else "/retrieve")
        self.timeout, self.max_retries, self.backoff = timeout, max_retries, backoff
        self.max_failure_rate, self.min_calls, self.window = max_failure_rate, min_calls, window
        self.max_consecutive_failures, self.deadline, self.server = max_consecutive_failures, deadline, server
        self.max_connections = max_connections
        self._recent: deque[bool] = deque(maxlen=window)  # one entry per search (query): True if it failed
        self._consecutive = 0  # failed requests since the last answered one
        self._consecutive_searches = 0  # the searches of those requests
        self._failing = False  # in an episode of failures: its first failure has been logged
        self._tripped: str | None = None  # the breaker's message once it has stopped the run
        self._lock = threading.Lock()  # tools may run in worker threads (tool_execution="thread") or concurrently
        self._http = None  # the httpx.Client, made at the first request (and again in a forked process)
        self._http_pid: int | None = None
        self._http_lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> RemoteRetriever:
        """The client itself: a copy (an environment snapshot) talks to the same server, so it counts in one record."""
        return self

    def _client(self):
        """The pooled HTTP client of this process. A connection pool must not cross a fork (two processes would
        share one socket), so a child process makes its own."""
        import httpx

        with self._http_lock:
            if self._http is None or self._http_pid != os.getpid():
                limits = httpx.Limits(
                    max_connections=self.max_connections,
                    max_keepalive_connections=self.max_connections,
                    keepalive_expiry=self.KEEPALIVE_EXPIRY,
                )
                self._http = httpx.Client(timeout=self.timeout, limits=limits)
                self._http_pid = os.getpid()
            return self._http

    def close(self) -> None:
        """Close the pooled connections (a later search opens new ones)."""
        with self._http_lock:
            if self._http is not None and self._http_pid == os.getpid():
                self._http.close()
            self._http = None

    def _not_search_r1(self, what: str) -> RetrievalAPIError:
        return RetrievalAPIError(
            f"Retrieval server {self.endpoint} did not answer Search-R1's API: {what}. Expected {SEARCH_R1_RESPONSE}. "
            "Is --retriever_url the address of a Search-R1 retrieval server (`trl-tree retrieval-server` or "
            "Search-R1's retrieval_server.py), and not of another service?"
        )

    def _post(self, payload: dict[str, Any], timeout: float | None = None) -> Any:
        """One POST; raises httpx.HTTPStatusError on a 4xx/5xx, httpx.TransportError on a failed connection or
        timeout, RetrievalAPIError on a body that is not JSON."""
        response = self._client().post(self.endpoint, json=payload, timeout=timeout or self.timeout)
        response.raise_for_status()
        try:
            return response.json()
        except ValueError as e:  # HTML from a proxy or another service, a cut body
            kind = response.headers.get("content-type") or "no content type"
            raise self._not_search_r1(
                f"HTTP {response.status_code} with a body that is not JSON ({kind}: {shorten(repr(response.text), 200)})"
            ) from e

    def _remaining(self, started: float) -> float | None:
        return None if self.deadline is None else self.deadline - (time.monotonic() - started)

    def _abandoned(self, attempts: int, last_error: BaseException | None) -> TimeoutError:
        last = f"; the last error: {_describe_http_error(last_error)}" if last_error is not None else ""
        return TimeoutError(
            f"Retrieval server {self.endpoint}: the search passed its deadline of {self.deadline:g}s (the trainer's "
            f"tool_timeout) after {attempts} attempt(s) and is not retried further{last}."
        )

    def _post_with_retries(self, payload: dict[str, Any]) -> Any:
        """POST, retrying on connection errors, timeouts and 5xx until `max_retries` or the search's `deadline`; a 4xx
        is the caller's error and a wrong-shape answer the server's API, neither retried. The child server (if any) is
        polled before each attempt and after a failed one."""
        import httpx

        started = time.monotonic()
        last_error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                pause = self.backoff * 2 ** (attempt - 1)
                remaining = self._remaining(started)
                if remaining is not None and remaining <= pause:
                    raise self._abandoned(attempt, last_error) from last_error
                time.sleep(pause)
            self._check_server()
            remaining = self._remaining(started)
            if remaining is not None and remaining <= 0:
                raise self._abandoned(attempt, last_error) from last_error
            try:
                return self._post(payload, self.timeout if remaining is None else min(self.timeout, remaining))
            except httpx.HTTPStatusError as e:
                if e.response.status_code < 500:
                    raise RuntimeError(
                        f"Retrieval server {self.endpoint} rejected the request: HTTP {e.response.status_code}: "
                        f"{e.response.text[:500]}"
                    ) from e
                last_error = e
            except (httpx.TransportError, OSError) as e:  # refused, reset, closed, DNS, timeouts
                last_error = e
                self._check_server()  # a child that exited refuses connections: say why now, not after the retries
        raise ConnectionError(
            f"Retrieval server {self.endpoint} did not answer after {self.max_retries + 1} attempts "
            f"(timeout {self.timeout}s each): {_describe_http_error(last_error)}. Is the server running?"
        ) from last_error

    def _parse(self, response: Any, queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        """The hits of a Search-R1 answer, or RetrievalAPIError saying how the answer departs from the API."""
        if not isinstance(response, dict) or "result" not in response:
            got = f"a JSON {type(response).__name__}" if not isinstance(response, dict) else f"keys {sorted(response)}"
            raise self._not_search_r1(f"the answer has no 'result' ({got}: {shorten(repr(response), 200)})")
        rows = response["result"]
        if not isinstance(rows, list):
            raise self._not_search_r1(f"'result' is a {type(rows).__name__} ({shorten(repr(rows), 200)}), not a list")
        if len(rows) != len(queries):
            raise self._not_search_r1(f"'result' has {len(rows)} rows for {len(queries)} queries")
        hits = []
        for i, row in enumerate(rows):
            if not isinstance(row, list):
                raise self._not_search_r1(f"row {i} of 'result' is a {type(row).__name__}, not a list of passages")
            try:
                hits.append([_parse_remote_hit(entry) for entry in row[:topk]])
            except (KeyError, TypeError) as e:
                raise self._not_search_r1(f"row {i} of 'result': {e.args[0] if e.args else e}") from e
        return hits

    def search(self, queries: list[str], topk: int = DEFAULT_TOPK) -> list[list[dict[str, Any]]]:
        """Top-``topk`` passages per query from the server.

        A failed search raises its error (``ConnectionError`` when the server does not answer, after the retries;
        ``TimeoutError`` past ``deadline``; ``RetrievalAPIError`` for an answer of the wrong shape), or
        ``ToolFatalError`` when the server is gone (see the class docstring).
        """
        queries = list(queries)
        self._raise_if_tripped()
        payload = {"queries": queries, "topk": topk, "return_scores": True}
        try:
            hits = self._parse(self._post_with_retries(payload), queries, topk)
        except (KeyboardInterrupt, ToolFatalError):
            raise
        except BaseException as error:  # any failure counts, the trainer's tool deadline (a BaseException) included
            self._record(error, len(queries))
            raise
        self._record(None, len(queries))
        return hits

    def _fatal(self, message: str) -> ToolFatalError:
        return ToolFatalError(
            f"{message}. Stopping the run, which would otherwise train on searches that return only errors and learn "
            "nothing from them. Check that the server is running and reachable from this machine (its log may say "
            "why it fails), then resume from the last checkpoint (a RemoteRetriever with a higher "
            "max_failure_rate or max_consecutive_failures tolerates more)."
        )

    def _trip(self, message: str) -> ToolFatalError:
        """Open the breaker for good (under `_lock`): every later search raises this message at once."""
        if self._tripped is None:
            self._tripped = message
        return self._fatal(self._tripped)

    def _raise_if_tripped(self) -> None:
        if self._tripped is not None:
            raise self._fatal(self._tripped)

    def _check_server(self) -> None:
        """ToolFatalError when the child process serving the URL has exited (`server`)."""
        why = self.server.exit_error() if self.server is not None else None
        if why is not None:
            with self._lock:
                raise self._trip(f"Retrieval server {self.endpoint} is gone: {why}")

    def _record(self, error: BaseException | None, searches: int) -> None:
        """Count one request of `searches` searches; warn at the first failure of an episode, raise when a rule of the
        breaker trips (see the class docstring)."""
        with self._lock:
            if self._tripped is not None:  # another thread's search stopped the run meanwhile
                raise self._fatal(self._tripped) from error
            self._recent.extend([error is not None] * searches)
            failures, calls = sum(self._recent), len(self._recent)
            if error is None:
                self._consecutive = self._consecutive_searches = 0
                self._failing = self._failing and failures > 0  # the episode ends when the window forgets it
                return
            self._consecutive += 1
            self._consecutive_searches += searches
            reason = None
            if calls >= self.min_calls and failures > self.max_failure_rate * calls:
                reason = (
                    f"failed {failures} of the last {calls} searches, more than "
                    f"max_failure_rate={self.max_failure_rate:g}"
                )
            elif self.max_consecutive_failures is not None and self._consecutive >= self.max_consecutive_failures:
                reason = (
                    f"failed {self._consecutive} requests in a row ({self._consecutive_searches} searches, each "
                    f"request after {self.max_retries + 1} attempts) with no answer between them: "
                    f"max_consecutive_failures={self.max_consecutive_failures}"
                )
            if reason is not None:
                raise self._trip(f"Retrieval server {self.endpoint} {reason}; the last error: {error}") from error
            first = not self._failing
            self._failing = True
        if first:
            logger.warning(
                "Retrieval server %s failed a search (%s); the model gets an error observation and training goes on. "
                "It stops after %s failed requests in a row, or if more than %g of the last %d searches fail (now %d "
                "of %d). Further failures are not logged until the server has answered %d searches in a row.",
                self.endpoint,
                error,
                self.max_consecutive_failures,
                self.max_failure_rate,
                self.window,
                failures,
                calls,
                self.window,
            )

    def check(self) -> None:
        """One search, one attempt, outside the failure record: raise ConnectionError, naming the URL and how to start
        a server, when nothing answers at the URL as a Search-R1 server does. Call it before training."""
        import httpx

        try:
            self._parse(self._post({"queries": ["test"], "topk": 1, "return_scores": True}), ["test"], 1)
        except (httpx.HTTPError, OSError, ValueError) as error:  # refused, timed out, an HTTP error, not JSON
            raise ConnectionError(
                f"No Search-R1 retrieval server answers at {self.endpoint} ({_describe_http_error(error)}). "
                f"{SEARCH_R1_SERVER_HELP}."
            ) from error


# ---------------------------------------------------------------------------------------------------------------
# The search tool
# ---------------------------------------------------------------------------------------------------------------

# One docstring for both the function tool and the environment method: TRL reads the tool's JSON schema from it.
SEARCH_DOCSTRING = """Search the knowledge base and return the most relevant passages.

Args:
    query: What to search for, for example an entity name or a short question.

Returns:
    The top passages, one per line, as "Doc i (Title: title) text".
"""


def format_passages(hits: list[dict[str, Any]], max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """Search-R1's observation format, ``Doc i (Title: t) text`` per line, capped at ``max_chars`` with a marker.

    The marker tells the model the list was cut, so it does not take a clipped passage for a whole one.
    """
    if not hits:
        return "No results found."
    text = "\n".join(f"Doc {i} (Title: {hit['title']}) {hit['text']}" for i, hit in enumerate(hits, start=1))
    if len(text) <= max_chars:
        return text
    return text[: max(0, max_chars - len(TRUNCATION_MARKER))] + TRUNCATION_MARKER


@dataclass(frozen=True)
class SearchBackend:
    """The implementation behind the ``search`` tool and :class:`SearchEnv`: validate the query, retrieve, format.

    A bad query (not a string, empty, or longer than ``max_query_chars``) returns an ``Error: ...`` observation the
    model can read and correct, rather than an exception that would end the rollout. With
    ``long_query="truncate"`` an over-long query is cut to ``max_query_chars`` instead, as the paper does.
    """

    retriever: Retriever
    topk: int = DEFAULT_TOPK
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS
    max_chars: int = DEFAULT_MAX_CHARS
    long_query: Literal["error", "truncate"] = "error"

    def _query_error(self, query: Any) -> str | None:
        if not isinstance(query, str):
            return f"Error: the query must be a string, got {type(query).__name__}."
        if not query.strip():
            return "Error: the query is empty. Call search with a non-empty query."
        if len(query) > self.max_query_chars and self.long_query == "error":
            return f"Error: the query has {len(query)} characters; the limit is {self.max_query_chars}. Shorten it."
        return None

    def __call__(self, query: Any) -> str:
        return self.batch([{"query": query}])[0]

    def batch(self, calls: list[dict[str, Any]]) -> list[str]:
        """The observations of several calls (``{"query": ...}`` each), in order, from one ``retriever.search`` over
        their valid queries: the batched form of the ``search`` tool (one request to a retrieval server for the calls
        of a round). Each call's observation is the one it gets alone, its query errors included; a failure of the
        search itself (the server is down) is every call's, raised as it is raised for one call."""
        errors = [self._query_error(call.get("query")) for call in calls]
        queries = [call["query"].strip()[: self.max_query_chars] for call, e in zip(calls, errors) if e is None]
        hits = self.retriever.search(queries, self.topk) if queries else []
        if len(hits) != len(queries):
            raise ValueError(f"The retriever returned {len(hits)} result lists for {len(queries)} queries.")
        found = iter(hits)
        return [error if error is not None else format_passages(next(found), self.max_chars) for error in errors]


def make_search_tool(
    retriever: Retriever,
    topk: int = DEFAULT_TOPK,
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS,
    max_chars: int = DEFAULT_MAX_CHARS,
    long_query: Literal["error", "truncate"] = "error",
    max_batch_size: int | None = DEFAULT_MAX_BATCH_SIZE,
) -> Callable[[str], str]:
    """A stateless ``search(query: str) -> str`` function for TRL's ``tools=[...]``.

    TRL builds the tool's JSON schema from the function's name, type hints and docstring
    (``transformers.utils.get_json_schema``), so the returned closure is a plain function named ``search``. It
    declares a batched form (:func:`~trl_tree.rollout.tools.batched_tool`, :meth:`SearchBackend.batch`): the trainer
    sends the searches of one round, up to ``max_batch_size`` of them, to the retriever in one ``search`` call (one
    request to a retrieval server) and each call gets the observation it would get alone.
    """
    backend = SearchBackend(retriever, topk, max_query_chars, max_chars, long_query)

    @batched_tool(backend.batch, max_batch_size=max_batch_size)
    def search(query: str) -> str:
        return backend(query)

    search.__doc__ = SEARCH_DOCSTRING
    return search


class SearchEnv:
    """The search tool as a TRL ``environment_factory`` environment: ``reset(**row)`` and ``search(query)``.

    TRL exposes every public method except ``reset`` as a tool, so the class has no other public methods. It keeps
    the queries of the current rollout (``self.queries``). ``copy.deepcopy`` (how tree samplers snapshot an
    environment at a branch point) copies that history but shares the read-only retriever, so branching a rollout
    never duplicates an index. Build the zero-argument factory TRL wants with :func:`search_env_factory`.
    """

    def __init__(
        self,
        retriever: Retriever,
        topk: int = DEFAULT_TOPK,
        max_query_chars: int = DEFAULT_MAX_QUERY_CHARS,
        max_chars: int = DEFAULT_MAX_CHARS,
        long_query: Literal["error", "truncate"] = "error",
    ):
        self._backend = SearchBackend(retriever, topk, max_query_chars, max_chars, long_query)
        self.queries: list[str] = []

    def reset(self, **kwargs) -> None:
        """Start a new rollout (the dataset row arrives as keyword arguments; the prompt is left unchanged)."""
        self.queries = []

    def search(self, query: str) -> str:
        self.queries.append(query)
        return self._backend(query)

    search.__doc__ = SEARCH_DOCSTRING

    def __deepcopy__(self, memo: dict) -> SearchEnv:
        clone = copy.copy(self)
        clone.queries = copy.deepcopy(self.queries, memo)
        return clone


def search_env_factory(retriever: Retriever, **kwargs) -> Callable[[], SearchEnv]:
    """The zero-argument callable TRL's ``environment_factory`` expects; all environments share ``retriever``."""
    return functools.partial(SearchEnv, retriever, **kwargs)
