"""`trl-tree retrieval-server` as deployments run it: a real process on a free port of 127.0.0.1, queried over HTTP.

Properties: it answers what the in-process BM25 retriever answers (Search-R1's response shape, with and without
scores); concurrent requests are all answered, each with its own result; the client keeps its connections alive;
bad requests get a 4xx that says what was wrong and what to send; a training step searches through it; and a server
that dies mid-run stops the run with an error naming it, the checkpoint saved before intact.
"""

import contextlib
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import fastapi  # noqa: F401 - the server's dependency (extras retrieval, dev): missing, these tests fail
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from tests.scripted import AFTER_TOOL, scripted_trainer, tool_call
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer
from trl_tree.envs.hotpot import BM25Retriever, RemoteRetriever, build_corpus, make_search_tool
from trl_tree.envs.retrieval_server import RetrievalServerProcess, write_corpus
from trl_tree.envs.synthetic import make_synthetic_hotpot
from trl_tree.rollout.acting.tools import ToolFatalError, batch_form


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(make_synthetic_hotpot(40, seed=3))


@pytest.fixture(scope="module")
def bm25_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bm25")


@pytest.fixture(scope="module")
def bm25(corpus, bm25_cache):
    return BM25Retriever(corpus, cache_dir=bm25_cache)


@pytest.fixture(scope="module")
def corpus_file(corpus, tmp_path_factory):
    return write_corpus(corpus, tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


def _start(corpus_file, bm25_cache, log_path=None) -> RetrievalServerProcess:
    server = RetrievalServerProcess(
        ["--corpus_path", str(corpus_file), "--bm25_cache_dir", str(bm25_cache)],
        startup_timeout=120,
        log_path=log_path,
    )
    server.start()
    return server


@pytest.fixture(scope="module")
def server(corpus_file, bm25_cache):
    server = _start(corpus_file, bm25_cache)
    yield server
    server.stop()


def _queries(corpus) -> list[str]:
    """Entity names, multi-word questions, a word of many passages (ties at the top-k boundary), and no match."""
    titles = [doc["title"] for doc in corpus[:12]]
    return [*titles, f"{titles[0]} {titles[1]} band", "Who founded the band?", "band", "qwxzv nothing matches"]


def _health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=5).json()


def _post(server, body=None, **kwargs) -> httpx.Response:
    """POST /retrieve with `body` as JSON, or with the raw `content=` given."""
    if body is not None:
        kwargs["json"] = body
    return httpx.post(f"{server.url}/retrieve", timeout=5, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------------------------------


def test_the_server_answers_what_the_in_process_bm25_retriever_answers(server, corpus, bm25):
    retriever = RemoteRetriever(server.url, timeout=10)
    queries = _queries(corpus)
    for topk in (1, 3, 7):
        assert retriever.search(queries, topk) == bm25.search(queries, topk)


def test_without_scores_rows_are_bare_search_r1_documents(server, corpus, bm25):
    queries = _queries(corpus)[:4]
    rows = _post(server, {"queries": queries, "topk": 3}).json()["result"]
    expected = bm25.search(queries, 3)
    assert [[doc["id"] for doc in row] for row in rows] == [[hit["id"] for hit in row] for row in expected]
    for row, hits in zip(rows, expected):
        for doc, hit in zip(row, hits):
            assert set(doc) >= {"id", "contents"} and "score" not in doc
            assert doc["contents"] == f'"{hit["title"]}"\n{hit["text"]}'


def test_health_says_the_retriever_the_corpus_size_and_the_limits(server, corpus):
    health = _health(server)
    assert health["status"] == "ok" and health["retriever"] == "bm25"
    assert health["corpus_size"] == len(corpus) and health["topk_max"] >= health["topk"] >= 1


def test_concurrent_requests_are_all_answered_each_with_its_own_result(server, corpus, bm25):
    retriever = RemoteRetriever(server.url, timeout=30, max_connections=8)
    queries = _queries(corpus)
    jobs = [[queries[(i + j) % len(queries)] for j in range(1 + i % 3)] for i in range(64)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda batch: retriever.search(batch, 3), jobs))
    assert answers == [bm25.search(batch, 3) for batch in jobs]


def test_the_client_keeps_its_connections_alive(server, corpus):
    """Many searches, from several threads, over at most `max_connections` TCP connections (the server counts the
    client addresses it has served), where a connection per search would be 80."""
    before = _health(server)
    retriever = RemoteRetriever(server.url, timeout=30, max_connections=4)
    for query in _queries(corpus) * 2:
        retriever.search([query], 3)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda q: retriever.search([q], 3), _queries(corpus) * 3))
    after = _health(server)
    searches = 5 * len(_queries(corpus))
    assert after["requests"] - before["requests"] == searches
    assert after["client_connections"] - before["client_connections"] <= 4 < searches


class SlowRetriever:
    """Takes `seconds` per search and records how many searches ran at once."""

    def __init__(self, seconds: float, thread_safe: bool):
        self.seconds, self.thread_safe = seconds, thread_safe
        self.running = self.most = 0
        self.lock = threading.Lock()

    def search(self, queries, topk):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        return [[{"id": "0", "title": "T", "text": q, "score": 1.0}] for q in queries]


@contextlib.contextmanager
def _served_in_this_process(retriever):
    """The server's application on uvicorn in a thread of this process, on a free port of 127.0.0.1."""
    import uvicorn

    from trl_tree.envs.retrieval_server import _listen, create_app

    sock = _listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(retriever, "slow", 1), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        while not server.started:
            time.sleep(0.02)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("thread_safe", [True, False])
def test_searches_run_in_worker_threads_at_once_unless_the_retriever_is_not_thread_safe(thread_safe):
    """Eight 0.2 s searches requested together take about 0.2 s, not 1.6 s: the event loop hands each to a worker
    thread. A retriever that does not declare itself thread-safe gets them one at a time."""
    retriever = SlowRetriever(0.2, thread_safe)
    with _served_in_this_process(retriever) as url:
        client = RemoteRetriever(url, timeout=10, max_connections=8)
        start = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: client.search([f"q{i}"], 1), range(8)))
        elapsed = time.monotonic() - start
    assert [a[0][0]["text"] for a in answers] == [f"q{i}" for i in range(8)]
    if thread_safe:
        assert retriever.most > 1 and elapsed < 1.2
    else:
        assert retriever.most == 1 and elapsed >= 1.6


def test_a_search_that_fails_is_a_500_with_its_reason_and_the_server_keeps_serving():
    class Flaky:
        thread_safe = True
        calls = 0

        def search(self, queries, topk):
            type(self).calls += 1
            if type(self).calls == 1:
                raise MemoryError("index shard 3 is gone")
            return [[] for _ in queries]

    with _served_in_this_process(Flaky()) as url:
        response = httpx.post(f"{url}/retrieve", json={"queries": ["a"]}, timeout=5)
        assert response.status_code == 500 and "MemoryError: index shard 3 is gone" in response.json()["error"]
        assert RemoteRetriever(url, timeout=5).search(["a"], 3) == [[]]


# ---------------------------------------------------------------------------------------------------------------
# Bad requests
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"topk": 3}, "queries: Field required"),
        ({"queries": [], "topk": 3}, "'queries' is empty"),
        ({"queries": ["a", 7]}, "queries.1: Input should be a valid string"),
        ({"queries": "a question"}, "queries: Input should be a valid list"),
        ({"queries": ["a"], "topk": 0}, "'topk' is 0"),
        ({"queries": ["a"], "topk": 10**6}, "'topk' is 1000000; this server returns from 1 to 100"),
        ({"queries": ["a"] * 1025}, "1025 queries in one request; this server takes at most 1024"),
        ({"queries": ["a"], "topk": "3"}, "topk: Input should be a valid integer"),
        (["a", "b"], "the body is a JSON list, not an object"),
    ],
)
def test_a_bad_request_gets_a_422_saying_what_was_wrong_and_what_to_send(server, body, says):
    response = _post(server, body)
    assert response.status_code == 422
    error = response.json()["error"]
    assert says in error and "Send a JSON object" in error and '"queries"' in error


@pytest.mark.parametrize(
    ("content", "headers", "says"),
    [
        ('{"queries": ["a"', {"Content-Type": "application/json"}, "the body is not valid JSON"),
        ("queries=a", {}, "the body is not JSON"),
        ("", {"Content-Type": "application/json"}, "the body is missing"),
    ],
)
def test_a_body_that_is_not_json_gets_a_422_saying_so(server, content, headers, says):
    response = _post(server, content=content, headers=headers)
    assert response.status_code == 422 and says in response.json()["error"]


def test_the_client_reports_the_servers_reason_for_a_rejected_request(server):
    with pytest.raises(RuntimeError, match=r"HTTP 422.*'topk' is 500"):
        RemoteRetriever(server.url, timeout=5).search(["a"], topk=500)


def test_a_server_that_cannot_start_says_why_with_its_log(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(RuntimeError, match="exited with code") as error:
        RetrievalServerProcess(
            ["--corpus_path", str(missing)], startup_timeout=60, log_path=tmp_path / "server.log"
        ).start()
    assert str(missing) in str(error.value)


def test_a_query_over_the_length_cap_gets_a_422_saying_the_limit(server):
    response = _post(server, {"queries": ["a", "x" * 2049]})
    assert response.status_code == 422
    error = response.json()["error"]
    assert "query 1 has 2049 characters; this server takes at most 2048 per query (--max_query_chars)" in error
    assert "strings of at most 2048 characters each" in error


@pytest.fixture(scope="module")
def capped_server(corpus_file, bm25_cache):
    """A server started with small caps, to show the flags reach it (and a 413 without sending megabytes)."""
    server = RetrievalServerProcess(
        [
            "--corpus_path",
            str(corpus_file),
            "--bm25_cache_dir",
            str(bm25_cache),
            "--max_body_bytes",
            "2000",
            "--max_query_chars",
            "50",
            "--max_queries",
            "8",
        ],
        startup_timeout=120,
    )
    server.start()
    yield server
    server.stop()


def test_the_caps_are_set_by_flags_and_shown_by_health(capped_server):
    health = _health(capped_server)
    assert (health["max_body_bytes"], health["max_query_chars"], health["max_queries"]) == (2000, 50, 8)
    assert _post(capped_server, {"queries": ["band"] * 8}).status_code == 200
    too_long = _post(capped_server, {"queries": ["x" * 51]})
    assert too_long.status_code == 422 and "at most 50 per query (--max_query_chars)" in too_long.json()["error"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_size_cap_gets_a_413_saying_the_limits(capped_server, chunked):
    """Refused before it is parsed (or, sent in chunks without a length, as soon as it passes the cap); the error
    says the body's size, the cap and its flag, and what to send instead."""
    body = json.dumps({"queries": ["q" * 40] * 60}).encode()  # 2,700 bytes
    content = iter([body[:1000], body[1000:]]) if chunked else body
    response = _post(capped_server, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    error = response.json()["error"]
    size = r"\d+ or more" if chunked else str(len(body))  # in chunks: what had arrived when it passed the cap
    assert re.search(
        f"Request body too large: {size} bytes; this server takes at most 2000 bytes per request "
        r"\(--max_body_bytes\)",
        error,
    )
    assert "at most 8 queries of at most 50 characters each" in error
    assert _post(capped_server, {"queries": ["band"]}).status_code == 200  # and it goes on serving


def test_a_child_server_that_exits_stops_the_next_search_naming_its_exit_and_log(corpus_file, bm25_cache, tmp_path):
    """Polled before the search: the exit is noticed at once (not after the retries of a refused connection), and
    the error names the server, how it ended and the log that says why."""
    log = tmp_path / "server.log"
    server = _start(corpus_file, bm25_cache, log_path=log)
    try:
        retriever = RemoteRetriever(server.url, timeout=5, max_retries=3, backoff=0.05, server=server)
        assert retriever.search(["band"], 1)
        server.process.kill()
        server.process.wait()
        with pytest.raises(ToolFatalError) as error:
            retriever.search(["band"], 1)
        with pytest.raises(ToolFatalError):  # and every later search
            retriever.search(["band"], 1)
    finally:
        server.stop()
    message = str(error.value)
    assert f"{server.url}/retrieve is gone" in message and "exited with code -9 (killed by SIGKILL)" in message
    assert str(log) in message and "last checkpoint" in message and log.is_file()


# ---------------------------------------------------------------------------------------------------------------
# The search tool's batched form, against the server
# ---------------------------------------------------------------------------------------------------------------


def test_a_batched_search_is_one_request_and_equals_the_single_calls(server, corpus):
    search = make_search_tool(RemoteRetriever(server.url, timeout=10), max_query_chars=40, long_query="error")
    queries = [*_queries(corpus)[:6], "", "x" * 41, "   "]
    before = _health(server)["requests"]
    batched = batch_form(search).fn([{"query": q} for q in queries])
    assert _health(server)["requests"] - before == 1
    assert batched == [search(q) for q in queries]
    assert batched[6].startswith("Error: the query is empty") and batched[7].startswith("Error: the query has 41")


# ---------------------------------------------------------------------------------------------------------------
# Training against the server
# ---------------------------------------------------------------------------------------------------------------


class SearchThenAnswer:
    """A scripted policy: search for `query`, then answer 2 once the result is in."""

    def __init__(self, tokenizer, query: str):
        self.tokenizer, self.query = tokenizer, query
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prefix: list[int]) -> list[int]:
        text = self.tokenizer.decode(prefix, skip_special_tokens=False)
        reply = "The answer is 2." if text.endswith(AFTER_TOOL) else tool_call("search", query=self.query)
        return self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos]


def _observations(completions) -> list[str]:
    return [m["content"] for c in completions for m in c if m.get("role") == "tool"]


def _search_trainer(tmp_path, url, reward_funcs, callbacks=(), **overrides):
    """A one-prompt TreeOPSD trainer of the tiny model whose scripted policy searches through the server at `url`
    (one passage per search: the observation fits the completion budget), its breaker quick to trip."""
    retriever = RemoteRetriever(url, timeout=5, max_retries=0, max_failure_rate=0.5, min_calls=2, window=2)
    return scripted_trainer(
        TreeOPSDTrainer,
        TreeOPSDConfig,
        tmp_path,
        script=lambda tok: SearchThenAnswer(tok, "band"),
        reward_funcs=reward_funcs,
        tools=(make_search_tool(retriever, topk=1),),
        callbacks=callbacks,
        max_completion_length=512,
        **overrides,
    )


def test_a_training_step_searches_through_the_server(server, bm25, tmp_path):
    seen = []

    def reward(completions, **kwargs):
        seen.extend(_observations(completions))
        return [1.0 if "2" in (c[-1].get("content") or "") else 0.0 for c in completions]

    before = _health(server)["requests"]
    trainer = _search_trainer(tmp_path, server.url, reward)
    trainer.train()
    assert trainer.state.global_step == 1 and _health(server)["requests"] > before
    expected = make_search_tool(bm25, topk=1)("band")
    assert seen and all(observation == expected for observation in seen)


class KillServerAfterFirstSave(TrainerCallback):
    """Kills the server (SIGKILL: no goodbye) once the first checkpoint is on disk, and keeps that step's weights."""

    def __init__(self, server: RetrievalServerProcess):
        self.server, self.saved = server, None

    def on_save(self, args, state, control, model=None, **kwargs):
        if self.saved is None:
            self.saved = {name: p.detach().clone() for name, p in model.state_dict().items()}
            self.server.process.kill()
            self.server.process.wait()


def test_a_server_that_dies_mid_run_stops_it_with_an_error_and_the_checkpoint_survives(
    corpus_file, bm25_cache, tmp_path
):
    server = _start(corpus_file, bm25_cache, log_path=tmp_path / "server.log")  # a killed server's log is kept
    killer = KillServerAfterFirstSave(server)
    try:
        trainer = _search_trainer(
            tmp_path,
            server.url,
            lambda completions, **kw: [0.0] * len(completions),
            callbacks=(killer,),
            max_steps=4,
            save_strategy="steps",
            save_steps=1,
        )
        with pytest.raises(ToolFatalError) as error:
            trainer.train()
    finally:
        server.stop()
    message = str(error.value)
    assert f"{server.url}/retrieve" in message and "failed" in message and "last checkpoint" in message
    checkpoint = tmp_path / "checkpoint-1"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 1
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    loaded = model.state_dict()
    assert killer.saved is not None and all(torch.equal(loaded[name], killer.saved[name]) for name in loaded)


# ---------------------------------------------------------------------------------------------------------------
# The HotpotQA example starts its own server
# ---------------------------------------------------------------------------------------------------------------


def test_the_example_starts_a_server_over_its_corpus_and_stops_it(bm25_cache):
    from trl_tree.scripts.hotpot import _OWN_SERVERS, HotpotDataArguments, build_retriever, stop_retrieval_servers

    examples = make_synthetic_hotpot(12, seed=5)
    args = HotpotDataArguments(retriever="server", bm25_cache_dir=str(bm25_cache))
    try:
        retriever = build_retriever(args, examples)
        (server,) = _OWN_SERVERS
        written = list(server.owned_paths)
        local = BM25Retriever(build_corpus(examples), cache_dir=bm25_cache)
        queries = [e["question"] for e in examples]
        assert isinstance(retriever, RemoteRetriever) and retriever.search(queries, 3) == local.search(queries, 3)
    finally:
        stop_retrieval_servers()
    assert server.process.poll() is not None and not _OWN_SERVERS
    assert written and not any(path.exists() for path in written)  # the corpus file written for it is gone


def test_the_synthetic_server_serves_the_offline_examples_corpus(bm25_cache):
    """`--synthetic` with its defaults indexes the paragraphs the offline example's in-process BM25 searches."""
    import argparse

    from trl_tree.envs.retrieval_server import add_arguments, build_corpus_and_retriever
    from trl_tree.scripts.hotpot import OFFLINE_SCRIPT_DEFAULTS, HotpotDataArguments, load_questions

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server_corpus, _ = build_corpus_and_retriever(
        parser.parse_args(["--synthetic", "--bm25_cache_dir", str(bm25_cache)])
    )
    offline = HotpotDataArguments(
        num_train=OFFLINE_SCRIPT_DEFAULTS["num_train"], num_eval=OFFLINE_SCRIPT_DEFAULTS["num_eval"]
    )
    train, held_out = load_questions(offline)
    assert server_corpus == build_corpus(train + held_out)


def test_threads_share_one_client():
    retriever = RemoteRetriever("http://127.0.0.1:9", timeout=1)
    clients = []
    threads = [threading.Thread(target=lambda: clients.append(retriever._client())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(c) for c in clients}) == 1
