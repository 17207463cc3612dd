"""Properties of the HotpotQA environment: loading both layouts, corpora, retrievers, the search tool, the prompt."""

import copy
import http.server
import inspect
import json
import logging
import socket
import sys
import threading
import time
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers.utils import get_json_schema

from trl_tree.envs.hotpot import (
    TRUNCATION_MARKER,
    BM25Retriever,
    DenseRetriever,
    RemoteRetriever,
    SearchEnv,
    build_corpus,
    build_prompt,
    format_passages,
    load_corpus,
    load_hotpot_dataset,
    load_hotpot_examples,
    make_search_tool,
    search_env_factory,
    top_k_by_score,
)
from trl_tree.envs.synthetic import make_synthetic_hotpot
from trl_tree.rollout.acting.tools import ToolFatalError, batch_form, run_tool_call


@pytest.fixture(scope="module")
def examples():
    return make_synthetic_hotpot(60, seed=7)


@pytest.fixture(scope="module")
def corpus(examples):
    return build_corpus(examples)


@pytest.fixture(scope="module")
def bm25(corpus, tmp_path_factory):
    return BM25Retriever(corpus, cache_dir=tmp_path_factory.mktemp("bm25"))


class FakeRetriever:
    """Returns ``n`` long passages whatever the query, and records the queries."""

    def __init__(self, n=3, length=100):
        self.n, self.length, self.queries = n, length, []

    def search(self, queries, topk):
        self.queries += queries
        return [[{"title": f"T{i}", "text": "x" * self.length, "score": 1.0} for i in range(min(topk, self.n))]]


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def _original_layout(example):
    """The example as the original HotpotQA JSON release stores it: pairs instead of dicts of lists, ``_id``."""
    record = {k: v for k, v in example.items() if k not in {"id", "context", "supporting_facts"}}
    record["_id"] = example["id"]
    record["context"] = [[t, s] for t, s in zip(example["context"]["title"], example["context"]["sentences"])]
    facts = example["supporting_facts"]
    record["supporting_facts"] = [[t, i] for t, i in zip(facts["title"], facts["sent_id"])]
    return record


def _write(path, records):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records))
    return path


def test_both_layouts_and_all_file_types_load_to_the_same_examples_and_corpus(examples, tmp_path):
    original = [_original_layout(e) for e in examples]
    files = [_write(tmp_path / f"datasets{suffix}", examples) for suffix in (".json", ".jsonl", ".parquet")]
    files += [_write(tmp_path / f"original{suffix}", original) for suffix in (".json", ".jsonl")]
    for file in files:
        loaded = load_hotpot_examples(file)
        assert loaded == examples, file.name
        assert build_corpus(loaded) == build_corpus(examples)


def test_a_folder_is_read_like_a_local_copy_of_the_hub_repo(examples, tmp_path):
    (tmp_path / "distractor").mkdir()
    _write(tmp_path / "distractor" / "train-00000-of-00002.parquet", examples[:30])
    _write(tmp_path / "distractor" / "train-00001-of-00002.parquet", examples[30:])
    _write(tmp_path / "distractor" / "validation-00000-of-00001.parquet", examples[:5])
    assert load_hotpot_examples(tmp_path, "distractor", "train") == examples
    assert len(load_hotpot_examples(tmp_path, "distractor", "validation")) == 5


def test_missing_question_or_answer_names_missing_and_found_columns(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"id": "1", "query": "q?", "context": []}])
    with pytest.raises(ValueError) as error:
        load_hotpot_examples(path)
    message = str(error.value)
    assert "['question', 'answer']" in message and "'query'" in message and "'context'" in message


def test_load_hotpot_dataset_gives_trainer_ready_columns(examples, tmp_path):
    dataset = load_hotpot_dataset(_write(tmp_path / "d.jsonl", examples), limit=10)
    assert len(dataset) == 10
    assert set(dataset.column_names) == {"prompt", "question", "answer", "id"}
    row = dataset[0]
    assert row["prompt"] == build_prompt(examples[0]["question"])
    assert (row["question"], row["answer"], row["id"]) == (
        examples[0]["question"],
        examples[0]["answer"],
        "synthetic-7-000000",
    )


def test_prompt_is_search_r1_instruction_then_question():
    prompt = build_prompt("Who founded Zorblax Inc.?")
    assert [m["role"] for m in prompt] == ["system", "user"]
    user = prompt[1]["content"]
    assert "search" in user and "<answer> and </answer>" in user and "<answer> Beijing </answer>" in user
    assert user.rstrip().endswith("Question: Who founded Zorblax Inc.?")
    assert [m["role"] for m in build_prompt("q", system_prompt=None)] == ["user"]


# ---------------------------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------------------------


def test_build_corpus_keeps_each_title_once(examples, corpus):
    titles = [doc["title"] for doc in corpus]
    assert len(titles) == len(set(titles)) == len({t for e in examples for t in e["context"]["title"]})
    assert all(set(doc) == {"id", "title", "text"} for doc in corpus)


def test_load_corpus_reads_both_formats(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [{"id": "a", "title": "Zorblax", "text": "A company."}, {"id": "b", "contents": '"Brevona"\nA city.'}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    assert load_corpus(path) == [
        {"id": "a", "title": "Zorblax", "text": "A company."},
        {"id": "b", "title": "Brevona", "text": "A city."},
    ]


@pytest.mark.parametrize("bad_line", ['{"id": "b", "title": "no text"}', '{"id": "b", "contents": ', "[1, 2]"])
def test_malformed_corpus_line_names_file_and_line(tmp_path, bad_line):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"title": "t", "text": "x"}) + "\n\n" + bad_line + "\n")
    with pytest.raises(ValueError, match=r"corpus\.jsonl, line 3"):
        load_corpus(path)


# ---------------------------------------------------------------------------------------------------------------
# Retrievers
# ---------------------------------------------------------------------------------------------------------------


def test_bm25_finds_the_paragraph_of_each_hop_entity_in_top_3(examples, bm25):
    """Querying each supporting paragraph's entity (the one the question names, then the bridge entity the first
    passage names) puts that paragraph in BM25's top 3. Measured: 120/120 = 1.00 (names are unique made-up words)."""
    queries = [title for e in examples for title in e["supporting_facts"]["title"]]
    results = bm25.search(queries, topk=3)
    rate = sum(q in [hit["title"] for hit in hits] for q, hits in zip(queries, results)) / len(queries)
    assert rate >= 0.8
    assert all(hits[0]["score"] >= hits[-1]["score"] for hits in results)


def test_bm25_omits_passages_sharing_no_term_with_the_query(bm25):
    assert bm25.search(["qqqqzzzz"], topk=3) == [[]]


def test_bm25_index_is_reused_from_disk_for_the_same_corpus(corpus, tmp_path, monkeypatch):
    import bm25s

    first = BM25Retriever(corpus, cache_dir=tmp_path)
    assert not first.from_cache and first.cache_path.is_dir()

    def no_indexing(*args, **kwargs):
        raise AssertionError("the index should have been loaded from the cache")

    monkeypatch.setattr(bm25s.BM25, "index", no_indexing)
    second = BM25Retriever(corpus, cache_dir=tmp_path)
    assert second.from_cache and second.cache_path == first.cache_path
    assert second.search(["Zorblax", corpus[5]["title"]], 3) == first.search(["Zorblax", corpus[5]["title"]], 3)
    monkeypatch.undo()
    assert not BM25Retriever(corpus[:-1], cache_dir=tmp_path).from_cache  # another corpus, another index


def test_top_k_by_score_is_highest_first_with_ties_in_index_order():
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(200):
        scores = rng.integers(0, 4, size=int(rng.integers(1, 30))).astype(np.float32)  # many ties
        k = int(rng.integers(1, 8))
        reference = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
        assert top_k_by_score(scores, k) == reference


def test_bm25_ties_are_broken_by_corpus_order_whatever_order_a_partition_leaves_them(monkeypatch):
    """Equal BM25 scores are common on templated corpora (174 of the synthetic task's 248 questions tie at its
    top-2 boundary), and numpy's partition orders equal keys differently on CPUs with and without AVX-512: the
    same query gave other passages, so other observations and another warm start, on another machine."""
    import numpy as np

    corpus = [{"id": str(i), "title": f"Twin {i}", "text": "the river flows past the mill"} for i in range(6)]
    retriever = BM25Retriever(corpus, use_cache=False)
    expected = [["0", "1", "2"]]
    assert [[h["id"] for h in hits] for hits in retriever.search(["river mill"], topk=3)] == expected

    real_partition = np.partition

    def reversed_ties(a, kth, *args, **kwargs):  # another machine's tie order: the same values, other positions
        return real_partition(a[::-1], kth, *args, **kwargs)

    monkeypatch.setattr(np, "partition", reversed_ties)
    assert [[h["id"] for h in hits] for hits in retriever.search(["river mill"], topk=3)] == expected


class BagOfWordsEncoder:
    """A fake sentence encoder: hashed bag of words (crc32: Python's `hash` is salted per process, which made the
    buckets collide differently from run to run); records what it was asked to encode."""

    def __init__(self):
        self.texts = []

    def encode(self, texts, batch_size=32):
        import numpy as np

        self.texts += texts
        vectors = np.zeros((len(texts), 4096))
        for row, text in enumerate(texts):
            for word in text.lower().replace(":", " ").split():
                vectors[row, zlib.crc32(word.strip(".,?").encode()) % 4096] += 1
        return vectors


def test_dense_retriever_uses_e5_prefixes_and_ranks_by_cosine(corpus):
    encoder = BagOfWordsEncoder()
    retriever = DenseRetriever(corpus, encoder=encoder)
    assert all(text.startswith("passage: ") for text in encoder.texts) and len(encoder.texts) == len(corpus)
    title = corpus[3]["title"]
    hits = retriever.search([title], topk=3)[0]
    assert encoder.texts[-1] == f"query: {title}"
    assert hits[0]["title"] == title and len(hits) == 3
    assert hits[0]["score"] >= hits[1]["score"] >= hits[2]["score"]


def test_dense_retriever_without_sentence_transformers_says_how_to_install(corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # import now fails, no download attempted
    with pytest.raises(ImportError, match=r"pip install trl-tree\[dense\]"):
        DenseRetriever(corpus)


class _RetrievalHandler(http.server.BaseHTTPRequestHandler):
    """A Search-R1 style /retrieve endpoint: wrapped entries for the first query, bare documents for the others."""

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        docs = [{"id": str(i), "contents": f'"Title {i}"\nText {i} for {{}}'} for i in range(request["topk"])]
        result = [
            [
                {"document": {**d, "contents": d["contents"].format(request["queries"][0])}, "score": 1.0 - i / 10}
                for i, d in enumerate(docs)
            ]
        ]
        result += [docs for _ in request["queries"][1:]]
        body = json.dumps({"result": result}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_remote_retriever_talks_to_a_search_r1_server():
    server = http.server.HTTPServer(("127.0.0.1", 0), _RetrievalHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        retriever = RemoteRetriever(f"http://127.0.0.1:{server.server_address[1]}", timeout=5)
        wrapped, bare = retriever.search(["zorblax", "brevona"], topk=2)
    finally:
        server.shutdown()
        server.server_close()
    assert wrapped == [
        {"id": "0", "title": "Title 0", "text": "Text 0 for zorblax", "score": 1.0},
        {"id": "1", "title": "Title 1", "text": "Text 1 for zorblax", "score": 0.9},
    ]
    assert [(h["title"], h["text"]) for h in bare] == [("Title 0", "Text 0 for {}"), ("Title 1", "Text 1 for {}")]


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_retriever_raises_connection_error_when_server_is_down():
    retriever = RemoteRetriever(f"http://127.0.0.1:{_closed_port()}", timeout=1, max_retries=2, backoff=0.05)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="3 attempts"):
        retriever.search(["q"], topk=3)
    assert time.monotonic() - start < 5


def test_remote_retriever_times_out_on_a_server_that_never_answers():
    with socket.socket() as listener:  # accepts connections into its backlog, never replies
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        retriever = RemoteRetriever(
            f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=0.3, max_retries=1, backoff=0.05
        )
        start = time.monotonic()
        with pytest.raises(ConnectionError):
            retriever.search(["q"], topk=3)
        assert time.monotonic() - start < 3


def _serve(handler):
    """A retrieval server on 127.0.0.1 (a free port), in a daemon thread; `_stop` closes its port."""
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _stop(server):
    server.shutdown()
    server.server_close()


def _search(tools, query="Zorblax"):
    """One search as the trainer's turn loop runs it: through the tool-call guard, with a deadline."""
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": query}}}
    return run_tool_call(call, tools, timeout=5, max_chars=None)


def _retriever_warnings(caplog):
    return [r for r in caplog.records if r.name == "trl_tree.envs.hotpot" and r.levelno == logging.WARNING]


def test_a_retrieval_server_that_dies_warns_then_stops_the_run_past_the_failure_rate(caplog):
    """At most `max_failure_rate` of the recent searches failed: each failure is an error observation (the model reads
    it, the run goes on) and the log warns once. Past it, the search raises ToolFatalError, which the tool-call guard
    lets through, so training stops with the server's URL instead of finishing on searches that all failed."""
    caplog.set_level(logging.WARNING, logger="trl_tree.envs.hotpot")
    server, url = _serve(_RetrievalHandler)
    retriever = RemoteRetriever(url, timeout=1, max_retries=0, max_failure_rate=0.5, min_calls=4, window=10)
    tools = {"search": make_search_tool(retriever)}
    try:
        assert [_search(tools).failed for _ in range(2)] == [False, False]
    finally:
        _stop(server)  # the port now refuses connections
    start = time.monotonic()
    observations = [_search(tools) for _ in range(2)]  # 1 of 3 failed, 2 of 4: not past 0.5
    assert all(r.failed and url in r.content for r in observations)
    warnings = _retriever_warnings(caplog)
    assert len(warnings) == 1 and url in warnings[0].getMessage()  # one warning for the episode, not one per call
    with pytest.raises(ToolFatalError) as error:
        _search(tools)  # 3 of 5 failed
    message = str(error.value)
    assert url in message and "3 of the last 5" in message and "max_failure_rate" in message
    assert time.monotonic() - start < 5


def _flaky_handler(failing: set[int]):
    """`_RetrievalHandler` that answers HTTP 500 to the requests numbered in `failing` (1-based)."""

    class Flaky(_RetrievalHandler):
        count = 0

        def do_POST(self):
            type(self).count += 1
            if type(self).count not in failing:
                return super().do_POST()
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Flaky


def test_sporadic_search_failures_do_not_stop_the_run_and_each_episode_warns_once(caplog):
    """A failure that the window forgets (all of the recent calls succeeded since) ends its episode: the next failure
    warns again. Below the threshold, nothing stops."""
    caplog.set_level(logging.WARNING, logger="trl_tree.envs.hotpot")
    server, url = _serve(_flaky_handler({3, 4, 10}))
    retriever = RemoteRetriever(url, timeout=1, max_retries=0, max_failure_rate=0.5, min_calls=2, window=4)
    try:
        failed = [_search({"search": make_search_tool(retriever)}).failed for _ in range(12)]
    finally:
        _stop(server)
    assert [i + 1 for i, f in enumerate(failed) if f] == [3, 4, 10]
    assert len(_retriever_warnings(caplog)) == 2  # requests 3-4 are one episode, request 10 another


def test_with_nothing_listening_searches_stop_after_min_calls():
    retriever = RemoteRetriever(f"http://127.0.0.1:{_closed_port()}", timeout=1, max_retries=0, min_calls=3)
    tools = {"search": make_search_tool(retriever)}
    start = time.monotonic()
    assert [_search(tools).failed for _ in range(2)] == [True, True]
    with pytest.raises(ToolFatalError, match="3 of the last 3"):
        _search(tools)
    assert time.monotonic() - start < 5


def test_the_hotpot_scripts_check_the_retrieval_server_before_training():
    """One search at start-up: a server that does not answer fails the script at once, naming the URL and how to
    start one, instead of after a model has been loaded (or, before, never)."""
    from trl_tree.scripts.hotpot import HotpotDataArguments, build_retriever

    url = f"http://127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    with pytest.raises(ConnectionError) as error:
        build_retriever(HotpotDataArguments(retriever="remote", retriever_url=url), [])
    message = str(error.value)
    assert url in message and "retrieval_server.py" in message and "--retriever bm25" in message
    # the offline example trains on the synthetic world, so the hint starts a server of that world first (issue 59)
    assert "trl-tree retrieval-server --synthetic --port PORT" in message
    assert time.monotonic() - start < 5
    server, url = _serve(_RetrievalHandler)
    try:
        retriever = build_retriever(HotpotDataArguments(retriever="remote", retriever_url=url), [])
        assert isinstance(retriever, RemoteRetriever) and retriever.search(["q"], topk=1)[0][0]["title"] == "Title 0"
    finally:
        _stop(server)


def _counting_handler(fail_from: int | None = None, fail_until: int | None = None, status: int = 500):
    """`_RetrievalHandler` that counts its requests (`.count`) and answers `status` to those numbered from `fail_from`
    to `fail_until` (1-based, inclusive; None: no end)."""

    class Counting(_RetrievalHandler):
        count = 0

        def do_POST(self):
            type(self).count += 1
            n = type(self).count
            if fail_from is None or n < fail_from or (fail_until is not None and n > fail_until):
                return super().do_POST()
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Counting


def test_a_failed_batched_request_counts_every_search_it_carried():
    """The breaker's window counts searches: a failed request of 10 queries is 10 failed searches, which fill a
    window of 10 (one entry per request would be 1 call, under `min_calls`, and the run would go on)."""
    server, url = _serve(_counting_handler(fail_from=1))
    retriever = RemoteRetriever(
        url, timeout=5, max_retries=0, max_failure_rate=0.5, min_calls=10, window=10, max_consecutive_failures=None
    )
    try:
        with pytest.raises(ToolFatalError, match="failed 10 of the last 10 searches"):
            retriever.search([f"q{i}" for i in range(10)], topk=1)
    finally:
        _stop(server)


def test_the_searches_a_batched_request_answered_count_as_answered():
    """Nine searches answered in one request, then one failed: 1 of 10 failed, under the rate (counted per request it
    would be 1 of 2, over it)."""
    server, url = _serve(_counting_handler(fail_from=2))
    retriever = RemoteRetriever(
        url, timeout=5, max_retries=0, max_failure_rate=0.4, min_calls=2, window=10, max_consecutive_failures=None
    )
    try:
        assert len(retriever.search([f"q{i}" for i in range(9)], topk=1)) == 9
        with pytest.raises(ConnectionError):
            retriever.search(["q"], topk=1)
    finally:
        _stop(server)


def test_consecutive_failed_requests_stop_the_run_whatever_the_window_held_and_it_stays_stopped():
    """A window full of answered searches (600 in one request) does not keep a dead server's run going: the third
    failed request in a row raises ToolFatalError, a success in between restarts the count, and after the trip every
    search raises at once, without a request (a search abandoned at its deadline may be the one that trips it)."""
    handler = _counting_handler(fail_from=2, fail_until=None)
    server, url = _serve(handler)
    retriever = RemoteRetriever(url, timeout=5, max_retries=0)  # the defaults: window 1000, 3 requests in a row
    tools = {"search": make_search_tool(retriever)}
    try:
        assert len(retriever.search([f"q{i}" for i in range(600)], topk=1)) == 600
        assert [_search(tools).failed for _ in range(2)] == [True, True]
        with pytest.raises(ToolFatalError) as error:
            _search(tools)
        assert handler.count == 4
        with pytest.raises(ToolFatalError):
            _search(tools)
        assert handler.count == 4  # no request: the breaker stays open
    finally:
        _stop(server)
    message = str(error.value)
    assert url in message and "3 requests in a row" in message and "max_consecutive_failures=3" in message
    assert "last checkpoint" in message


def test_an_answer_between_failed_requests_restarts_their_count():
    """Two failed requests, an answer, two more: never three in a row, so the run goes on."""

    class FailTwiceOfThree(_RetrievalHandler):
        count = 0

        def do_POST(self):
            type(self).count += 1
            if type(self).count % 3 == 0:
                return super().do_POST()
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server, url = _serve(FailTwiceOfThree)
    retriever = RemoteRetriever(url, timeout=5, max_retries=0, max_failure_rate=1.0)
    try:
        failed = [_search({"search": make_search_tool(retriever)}).failed for _ in range(9)]
    finally:
        _stop(server)
    assert failed == [True, True, False] * 3


def _answering(status: int, body: bytes, content_type: str):
    class Answering(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    return Answering


@pytest.mark.parametrize(
    ("body", "content_type", "says"),
    [
        (
            b"<html><body>Welcome to nginx!</body></html>",
            "text/html",
            "HTTP 200 with a body that is not JSON (text/html",
        ),
        (b'{"result": "x"}', "application/json", "'result' is a str"),
        (b'{"answer": []}', "application/json", "the answer has no 'result' (keys ['answer']"),
        (b'["a", "b"]', "application/json", "the answer has no 'result' (a JSON list"),
        (b'{"result": [[], [], []]}', "application/json", "'result' has 3 rows for 2 queries"),
        (b'{"result": ["x", "y"]}', "application/json", "row 0 of 'result' is a str, not a list of passages"),
        (b'{"result": [["x"], []]}', "application/json", "row 0 of 'result': a passage is a str, not an object"),
        (b'{"result": [[{"document": {"id": "1"}}], []]}', "application/json", "neither 'contents' nor 'text'"),
    ],
)
def test_an_answer_of_the_wrong_shape_names_the_server_and_search_r1s_api(body, content_type, says):
    """HTTP 200 with HTML or another JSON shape reaches the model as what it is, not as "Expecting value" or
    "'str' object has no attribute 'get'": the server's URL, that it did not answer Search-R1's API, what it sent and
    what was expected."""
    from trl_tree.envs.hotpot import RetrievalAPIError

    server, url = _serve(_answering(200, body, content_type))
    retriever = RemoteRetriever(url, timeout=5, max_retries=2, backoff=0.01)
    try:
        with pytest.raises(RetrievalAPIError) as error:
            retriever.search(["a", "b"], topk=3)
        observation = _search({"search": make_search_tool(retriever)})
    finally:
        _stop(server)
    message = str(error.value)
    assert f"{url}/retrieve did not answer Search-R1's API" in message and says in message
    assert '{"result": [row, ...]}' in message  # what was expected
    assert observation.failed and f"{url}/retrieve did not answer Search-R1" in observation.content


def test_a_search_past_its_deadline_stops_retrying():
    """Once the search's deadline (the trainer's tool_timeout) has passed, the caller has answered the call "timed
    out" and no longer waits: the search gives up instead of retrying on (here 6 attempts would be made without
    a deadline; the pause before the third is longer than what is left)."""
    handler = _counting_handler(fail_from=1)
    server, url = _serve(handler)
    retriever = RemoteRetriever(
        url, timeout=5, max_retries=5, backoff=0.3, deadline=0.5, max_failure_rate=1.0, max_consecutive_failures=None
    )
    try:
        with pytest.raises(TimeoutError, match=r"passed its deadline of 0.5s .* not retried further"):
            retriever.search(["q"], topk=1)
    finally:
        _stop(server)
    assert 1 <= handler.count <= 2


@pytest.mark.parametrize(
    "settings",
    [
        {"deadline": 0},
        {"deadline": float("nan")},
        {"deadline": "5"},
        {"max_consecutive_failures": 0},
        {"max_consecutive_failures": 2.5},
    ],
)
def test_bad_breaker_settings_are_refused_naming_the_field(settings):
    with pytest.raises(ValueError, match=next(iter(settings))):
        RemoteRetriever("http://127.0.0.1:9", **settings)


def test_the_script_gives_remote_searches_the_tool_deadline():
    from types import SimpleNamespace

    from trl_tree.scripts.hotpot import HotpotScriptArguments, build_search_tool

    server, url = _serve(_RetrievalHandler)
    try:
        tool = build_search_tool(
            HotpotScriptArguments(retriever="remote", retriever_url=url),
            SimpleNamespace(tool_timeout=7.5, max_observation_chars=None),
            [],
        )
    finally:
        _stop(server)
    retriever = batch_form(tool).fn.__self__.retriever
    assert isinstance(retriever, RemoteRetriever) and retriever.deadline == 7.5


# ---------------------------------------------------------------------------------------------------------------
# The search tool
# ---------------------------------------------------------------------------------------------------------------


def test_search_tool_returns_top_passages_in_search_r1_format(bm25, corpus):
    search = make_search_tool(bm25)
    title = corpus[0]["title"]
    lines = search(f"{title} band").split("\n")  # "band" matches many paragraphs: more than 3 candidates
    assert len(lines) == 3
    assert lines[0] == f"Doc 1 (Title: {title}) {corpus[0]['text']}"
    assert lines[1].startswith("Doc 2 (Title: ")


def test_empty_or_overlong_query_returns_an_error_observation():
    retriever = FakeRetriever()
    search = make_search_tool(retriever, max_query_chars=20)
    for bad in ["", "   ", "x" * 21, None]:
        assert search(bad).startswith("Error:")
    assert retriever.queries == []  # nothing reached the retriever
    truncating = make_search_tool(retriever, max_query_chars=20, long_query="truncate")
    assert truncating("y" * 30).startswith("Doc 1") and retriever.queries == ["y" * 20]


@pytest.mark.parametrize("long_query", ["error", "truncate"])
def test_the_batched_search_is_one_retriever_call_and_equals_the_single_calls(bm25, corpus, long_query):
    """The search tool's batched form (what the trainer sends a round's searches through) gives every call the
    observation it gets alone, query errors included, from one `retriever.search` over the valid queries."""
    calls = []

    class Counting:
        def search(self, queries, topk):
            calls.append(list(queries))
            return bm25.search(queries, topk)

    search = make_search_tool(Counting(), max_query_chars=30, long_query=long_query, max_batch_size=8)
    queries = [corpus[0]["title"], "", f"{corpus[1]['title']} band " + "x" * 30, "   ", corpus[2]["title"], "qwxzv"]
    batched = batch_form(search).fn([{"query": q} for q in queries])
    assert len(calls) == 1 and batch_form(search).max_batch_size == 8
    assert batched == [search(q) for q in queries]
    valid = [q for q in queries if q.strip() and (long_query == "truncate" or len(q) <= 30)]
    assert calls[0] == [q.strip()[:30] for q in valid]
    assert batched[1].startswith("Error:") and batched[2].startswith("Error:" if long_query == "error" else "Doc 1")


def test_a_batched_search_whose_retriever_fails_fails_as_a_single_call_does():
    class Down:
        def search(self, queries, topk):
            raise ConnectionError("Retrieval server http://127.0.0.1:1/retrieve did not answer")

    search = make_search_tool(Down())
    for run in (lambda: batch_form(search).fn([{"query": "a"}, {"query": "b"}]), lambda: search("a")):
        with pytest.raises(ConnectionError, match="did not answer"):
            run()


def test_search_output_is_capped_with_a_visible_marker():
    search = make_search_tool(FakeRetriever(n=3, length=500), max_chars=700)
    output = search("anything")
    assert len(output) <= 700 and output.endswith(TRUNCATION_MARKER)
    assert not make_search_tool(FakeRetriever(n=1, length=50), max_chars=700)("q").endswith(TRUNCATION_MARKER)
    assert format_passages([]) == "No results found."


def test_tool_schema_builds_from_function_and_environment_method():
    function_schema = get_json_schema(make_search_tool(FakeRetriever()))
    method_schema = get_json_schema(SearchEnv(FakeRetriever()).search)
    assert function_schema == method_schema
    function = function_schema["function"]
    assert function["name"] == "search"
    assert function["parameters"]["properties"]["query"]["type"] == "string"
    assert function["parameters"]["required"] == ["query"]
    assert function["description"]


def test_search_env_exposes_only_reset_and_search_and_branches_cheaply():
    """TRL turns every public method but reset into a tool; deepcopy (branch snapshot) must not copy the index."""
    public = {n for n, _ in inspect.getmembers(SearchEnv, predicate=inspect.isfunction) if not n.startswith("_")}
    assert public == {"reset", "search"}
    retriever = FakeRetriever()
    env = search_env_factory(retriever, max_chars=1000)()
    env.reset(question="q", answer="a")
    assert env.search("first").startswith("Doc 1")
    branch = copy.deepcopy(env)
    branch.search("second")
    assert env.queries == ["first"] and branch.queries == ["first", "second"]
    assert branch._backend.retriever is retriever
    env.reset()
    assert env.queries == []
