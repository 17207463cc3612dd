"""A retrieval server of the project's own: `trl-tree retrieval-server`, Search-R1's API over BM25 (or dense) search.

Deployments of search agents run retrieval as a service that every training process queries, as Search-R1 does
(`search_r1/search/retrieval_server.py`, FastAPI + uvicorn). This module serves the same API, so that
:class:`~trl_tree.envs.hotpot.RemoteRetriever` and Search-R1's own clients talk to it unchanged:

- ``POST /retrieve`` with ``{"queries": [str, ...], "topk": int, "return_scores": bool}`` (``topk`` optional: the
  server's ``--topk``; ``return_scores`` optional: false, as in Search-R1) answers ``{"result": [row, ...]}``, one row
  per query, best first: ``[{"document": {...}, "score": float}, ...]`` with scores, else ``[{...document}, ...]``. A
  document is ``{"id", "contents": "\\"Title\\"\\ntext", "title", "text"}``: Search-R1's ``contents``, and the title
  and text as they are (``contents`` cannot carry a title with a quote exactly).
- ``GET /health``: ``{"status": "ok", "retriever", "corpus_size", "topk", "topk_max", "max_queries",
  "max_query_chars", "max_body_bytes", "requests", "client_connections"}`` (the last two: requests answered and
  distinct client connections seen, for monitoring).

A bad request is answered 422 with ``{"error": what was wrong and what to send, "detail": [...]}``; a search that
fails, 500 with its error. What one request may cost is capped, since a search's CPU time grows with its text: a body
over ``--max_body_bytes`` is answered 413 before it is read whole or parsed, more than ``--max_queries`` queries or a
query over ``--max_query_chars`` characters 422, each ``error`` saying the limits and the flag that sets them. Searches run in the server's worker threads (a ``def`` endpoint: FastAPI runs it in its
threadpool), so requests are served concurrently and the event loop never waits on a BM25 scoring; a retriever that
does not declare itself ``thread_safe`` is used under a lock.

:class:`RetrievalServerProcess` starts the server as a child process on a free port of 127.0.0.1 (what
``--retriever server`` of the HotpotQA example and the tests do) and stops it.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations, which name classes local to
# `create_app` (the request model, made there so that importing this module needs no FastAPI).
import argparse
import atexit
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .hotpot import DEFAULT_TOPK

DEFAULT_PORT = 8000
DEFAULT_TOPK_MAX = 100
DEFAULT_MAX_QUERIES = 1024  # queries per request: the search tool's batches (256 by default) fit
DEFAULT_MAX_QUERY_CHARS = 2048  # characters per query: 4x the search tool's 512 (queries are cut or refused there)
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # bytes per request body: twice the default max_queries x max_query_chars
DEFAULT_NUM_QUESTIONS = 64  # the offline example's synthetic world: num_train 32 + num_eval 32
KEEP_ALIVE_SECONDS = (
    30  # idle keep-alive connections live this long (clients drop theirs sooner: RemoteRetriever's 4 s)
)
MAX_TRACKED_CONNECTIONS = 65_536  # /health's client_connections stops counting here
READY_PREFIX = "trl-tree retrieval-server: ready at "  # the line a parent process waits for
PARENT_PID_ENV = "TRL_TREE_RETRIEVAL_SERVER_PARENT"  # set by RetrievalServerProcess: exit when that process is gone
REQUEST_SHAPE = '{"queries": ["...", ...], "topk": 3, "return_scores": true}'
HELP = (
    "Serve search over HTTP with Search-R1's API (POST /retrieve, GET /health): BM25 (or dense) over a JSONL corpus "
    "or the offline synthetic world. Train against it with --retriever remote --retriever_url URL."
)


def document(doc: dict[str, str]) -> dict[str, str]:
    """A passage as a Search-R1 document: ``contents`` is ``"Title"\\ntext``, the title and text are also given."""
    return {
        "id": str(doc.get("id", "")),
        "contents": f'"{doc.get("title", "")}"\n{doc["text"]}',
        "title": doc.get("title", ""),
        "text": doc["text"],
    }


def result_row(hits: list[dict[str, Any]], return_scores: bool) -> list[dict[str, Any]]:
    """One query's hits as Search-R1 answers them: ``{"document", "score"}`` entries, or bare documents."""
    docs = [document(hit) for hit in hits]
    if not return_scores:
        return docs
    return [{"document": doc, "score": float(hit["score"])} for doc, hit in zip(docs, hits)]


class RequestError(ValueError):
    """A request the server cannot answer: the message says what was wrong; the handler adds what to send."""


def check_request(
    queries: list[str],
    topk: int | None,
    default_topk: int,
    topk_max: int,
    max_queries: int,
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS,
) -> int:
    """The top-k to retrieve, or RequestError saying what is wrong with the queries or top-k (the types are pydantic's
    to check: a list of strings, an integer)."""
    if not queries:
        raise RequestError("'queries' is empty: send at least one query")
    if len(queries) > max_queries:
        raise RequestError(
            f"{len(queries)} queries in one request; this server takes at most {max_queries} "
            "(--max_queries): split them over several requests"
        )
    for i, query in enumerate(queries):
        if len(query) > max_query_chars:
            raise RequestError(
                f"query {i} has {len(query)} characters; this server takes at most {max_query_chars} "
                "per query (--max_query_chars): shorten it"
            )
    topk = default_topk if topk is None else topk
    if not 1 <= topk <= topk_max:
        raise RequestError(
            f"'topk' is {topk}; this server returns from 1 to {topk_max} passages per query (--topk_max)"
        )
    return topk


def _describe_validation_error(error: dict[str, Any]) -> str:
    """One of pydantic's errors in words: where in the body, and what."""
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    if error.get("type") == "json_invalid":
        return f"the body is not valid JSON ({error.get('ctx', {}).get('error', error.get('msg'))})"
    if not location:
        if error.get("type") == "missing":
            return "the body is missing"
        if isinstance(error.get("input"), (str, bytes)):  # FastAPI parses JSON only when the content type says so
            return "the body is not JSON (send it as JSON, with the header Content-Type: application/json)"
        return f"the body is a JSON {type(error.get('input')).__name__}, not an object"
    return f"{'.'.join(location)}: {error.get('msg')}"


def bad_request_message(
    what: str, topk_max: int, max_queries: int, max_query_chars: int = DEFAULT_MAX_QUERY_CHARS
) -> str:
    return (
        f"Bad request to POST /retrieve: {what}. Send a JSON object {REQUEST_SHAPE}: 'queries' a list of 1 to "
        f"{max_queries} strings of at most {max_query_chars} characters each, 'topk' (optional) an integer from "
        f"1 to {topk_max}, 'return_scores' (optional) true or false."
    )


def body_too_large_message(size: int, exact: bool, max_body_bytes: int, max_queries: int, max_query_chars: int) -> str:
    return (
        f"Request body too large: {size}{'' if exact else ' or more'} bytes; this server takes at most "
        f"{max_body_bytes} bytes per request (--max_body_bytes). Send fewer or shorter queries per request (at "
        f"most {max_queries} queries of at most {max_query_chars} characters each)."
    )


class BodySizeLimit:
    """ASGI middleware: a request whose body is over `max_bytes` is answered 413 with `{"error": message(size,
    exact)}`, without reading more of it than the limit, so a huge body costs neither the memory to hold it nor the
    CPU to parse it. A body within the limit is read here and handed to the application unchanged."""

    def __init__(self, app, max_bytes: int, message):
        self.app, self.max_bytes, self.message = app, max_bytes, message

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send, int(declared), exact=True)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nothing to answer
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._reject(send, size, exact=False)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _reject(self, send, size: int, exact: bool) -> None:
        payload = json.dumps({"error": self.message(size, exact)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


class _Stats:
    """Requests answered and distinct client connections seen (a connection is a client's host and port)."""

    def __init__(self):
        self.requests = 0
        self.connections: set[tuple[str, int]] = set()
        self.lock = threading.Lock()

    def record(self, client: Any) -> None:
        with self.lock:
            self.requests += 1
            if client is not None and len(self.connections) < MAX_TRACKED_CONNECTIONS:
                self.connections.add((client.host, client.port))


def create_app(
    retriever,
    kind: str,
    corpus_size: int,
    topk: int = DEFAULT_TOPK,
    topk_max: int = DEFAULT_TOPK_MAX,
    max_queries: int = DEFAULT_MAX_QUERIES,
    on_ready=None,
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
):
    """The FastAPI application serving ``retriever`` (anything with ``search(queries, topk)``, e.g.
    :class:`~trl_tree.envs.hotpot.BM25Retriever`). ``on_ready()`` runs once the application has started."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

    class RetrieveRequest(BaseModel):
        model_config = ConfigDict(extra="ignore")  # Search-R1 clients may send more fields

        queries: list[StrictStr]
        topk: StrictInt | None = None
        return_scores: StrictBool = False

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="trl-tree retrieval server", lifespan=lifespan)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=max_body_bytes,
        message=lambda size, exact: body_too_large_message(size, exact, max_body_bytes, max_queries, max_query_chars),
    )
    lock = contextlib.nullcontext() if getattr(retriever, "thread_safe", False) else threading.Lock()
    stats = _Stats()

    def bad_request(what: str, detail: Any = None) -> JSONResponse:
        body = {"error": bad_request_message(what, topk_max, max_queries, max_query_chars), "detail": detail or what}
        return JSONResponse(status_code=422, content=body)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        from fastapi.encoders import jsonable_encoder

        errors = exc.errors()
        what = "; ".join(_describe_validation_error(e) for e in errors[:5]) or "the body is not a request object"
        if len(errors) > 5:
            what += f"; and {len(errors) - 5} more errors"
        detail = [{key: e[key] for key in ("type", "loc", "msg") if key in e} for e in errors]  # not the input back
        return bad_request(what, jsonable_encoder(detail))

    @app.exception_handler(RequestError)
    async def rejected_request(request: Request, exc: RequestError):
        return bad_request(str(exc))

    @app.post("/retrieve")
    def retrieve(body: RetrieveRequest, request: Request):
        k = check_request(body.queries, body.topk, topk, topk_max, max_queries, max_query_chars)
        try:
            with lock:
                hits = retriever.search(body.queries, k)
        except Exception as error:  # noqa: BLE001 - the client gets the reason, the server keeps serving
            logging.getLogger("uvicorn.error").exception("A search of %d queries failed", len(body.queries))
            return JSONResponse(
                status_code=500, content={"error": f"The search failed: {type(error).__name__}: {error}"}
            )
        stats.record(request.client)
        return {"result": [result_row(row, body.return_scores) for row in hits]}

    @app.get("/health")
    def health():
        with stats.lock:
            requests, connections = stats.requests, len(stats.connections)
        return {
            "status": "ok",
            "retriever": kind,
            "corpus_size": corpus_size,
            "topk": topk,
            "topk_max": topk_max,
            "max_queries": max_queries,
            "max_query_chars": max_query_chars,
            "max_body_bytes": max_body_bytes,
            "requests": requests,
            "client_connections": connections,
        }

    return app


# ---------------------------------------------------------------------------------------------------------------
# The command: `trl-tree retrieval-server`
# ---------------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    corpus = parser.add_mutually_exclusive_group(required=True)
    corpus.add_argument("--corpus_path", help="JSONL corpus: lines of {id, title, text} or Search-R1's {id, contents}")
    corpus.add_argument(
        "--synthetic",
        action="store_true",
        help="the offline example's synthetic multi-hop world (trl_tree.envs.synthetic)",
    )
    parser.add_argument(
        "--num_questions",
        type=int,
        default=DEFAULT_NUM_QUESTIONS,
        help="--synthetic: questions whose paragraphs make the corpus; the training example's "
        "num_train + num_eval (its offline default: 32 + 32)",
    )
    parser.add_argument("--synthetic_seed", type=int, default=0, help="--synthetic: seed of the world")
    parser.add_argument(
        "--retriever",
        choices=["bm25", "dense"],
        default="bm25",
        help="bm25 (bm25s, index cached on disk) or dense (E5 via sentence-transformers)",
    )
    parser.add_argument("--dense_model", default="intfloat/e5-base-v2", help="encoder of --retriever dense")
    parser.add_argument("--bm25_cache_dir", default=None, help="where BM25 indexes are cached")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: any free port; the URL printed says)")
    parser.add_argument("--topk", type=int, default=DEFAULT_TOPK, help="passages per query when a request gives none")
    parser.add_argument("--topk_max", type=int, default=DEFAULT_TOPK_MAX, help="largest topk a request may ask for")
    parser.add_argument("--max_queries", type=int, default=DEFAULT_MAX_QUERIES, help="most queries in one request")
    parser.add_argument(
        "--max_query_chars",
        type=int,
        default=DEFAULT_MAX_QUERY_CHARS,
        help="most characters in one query (longer: 422)",
    )
    parser.add_argument(
        "--max_body_bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="most bytes in one request body (larger: 413, before it is parsed)",
    )
    parser.add_argument("--access_log", action="store_true", help="log every request")


def build_corpus_and_retriever(args: argparse.Namespace) -> tuple[list[dict[str, str]], Any]:
    """The corpus and retriever the command line names."""
    from .hotpot import BM25Retriever, DenseRetriever, build_corpus, load_corpus

    if args.corpus_path is not None:
        corpus = load_corpus(args.corpus_path)
    else:
        from .synthetic import make_synthetic_hotpot

        corpus = build_corpus(make_synthetic_hotpot(args.num_questions, seed=args.synthetic_seed))
    if not corpus:
        raise ValueError(f"The corpus {args.corpus_path} holds no passages.")
    if args.retriever == "dense":
        return corpus, DenseRetriever(corpus, model_name=args.dense_model)
    return corpus, BM25Retriever(corpus, cache_dir=args.bm25_cache_dir)


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one). Bound here, before the index is served, so the port
    printed is the port served, with no window in which another process could take it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise SystemExit(
            f"trl-tree retrieval-server: cannot listen on {host}:{port} ({error}). Choose another "
            "--port (0: any free one)."
        ) from error
    sock.listen(2048)
    return sock


def _exit_with_parent(parent_pid: int) -> None:
    """Stop this server (SIGTERM to itself: uvicorn shuts down cleanly) when the process that started it is gone, so
    a training run killed without cleaning up leaves no server behind."""

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve(
    retriever,
    kind: str,
    corpus_size: int,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    topk: int = DEFAULT_TOPK,
    topk_max: int = DEFAULT_TOPK_MAX,
    max_queries: int = DEFAULT_MAX_QUERIES,
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    access_log: bool = False,
) -> None:
    """Serve ``retriever`` until SIGINT / SIGTERM; print ``READY_PREFIX`` + the URL once requests are accepted."""
    import uvicorn

    sock = _listen(host, port)
    url = _url(host, sock.getsockname()[1])

    def announce():
        print(
            f"{READY_PREFIX}{url} ({kind} over {corpus_size} passages; POST {url}/retrieve, GET {url}/health)",
            flush=True,
        )

    app = create_app(
        retriever,
        kind,
        corpus_size,
        topk,
        topk_max,
        max_queries,
        on_ready=announce,
        max_query_chars=max_query_chars,
        max_body_bytes=max_body_bytes,
    )
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=access_log,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    uvicorn.Server(config).run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    """`trl-tree retrieval-server ...`: build the retriever, then serve it."""
    parser = argparse.ArgumentParser(prog="trl-tree retrieval-server", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    for name in ("topk", "topk_max", "max_queries", "max_query_chars", "max_body_bytes", "num_questions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1; got {getattr(args, name)}.")
    if args.topk > args.topk_max:
        parser.error(f"--topk {args.topk} is more than --topk_max {args.topk_max}.")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"trl-tree retrieval-server needs FastAPI and uvicorn ({error}): `pip install trl-tree[retrieval]`."
        ) from error
    if os.environ.get(PARENT_PID_ENV):
        _exit_with_parent(int(os.environ[PARENT_PID_ENV]))
    started = time.time()
    try:
        corpus, retriever = build_corpus_and_retriever(args)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"trl-tree retrieval-server: {error}") from error
    print(
        f"trl-tree retrieval-server: {args.retriever} index of {len(corpus)} passages ready in "
        f"{time.time() - started:.1f}s",
        flush=True,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"trl-tree retrieval-server: listening on {args.host}: anyone who can reach this machine can search "
            "(there is no authentication)",
            flush=True,
        )
    serve(
        retriever,
        args.retriever,
        len(corpus),
        args.host,
        args.port,
        topk=args.topk,
        topk_max=args.topk_max,
        max_queries=args.max_queries,
        max_query_chars=args.max_query_chars,
        max_body_bytes=args.max_body_bytes,
        access_log=args.access_log,
    )
    return 0


# ---------------------------------------------------------------------------------------------------------------
# A server as a child process
# ---------------------------------------------------------------------------------------------------------------


def write_corpus(corpus: list[dict[str, str]], path: str | os.PathLike) -> Path:
    """``corpus`` as a JSONL file of ``{id, title, text}`` lines (what ``--corpus_path`` reads)."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for doc in corpus:
            f.write(json.dumps({"id": doc.get("id", ""), "title": doc.get("title", ""), "text": doc["text"]}) + "\n")
    return path


class RetrievalServerProcess:
    """``trl-tree retrieval-server`` as a child process on a free port of 127.0.0.1.

    :meth:`start` launches it with ``server_args`` (the corpus and retriever options), waits until it prints its URL
    and answers ``GET /health``, and returns the URL. :meth:`stop` ends it (SIGTERM, then SIGKILL after a grace
    period); it also runs at interpreter exit, and the server exits by itself within about a second when this process
    dies without stopping it (it watches its parent). The server's output goes to ``log_path`` (a temporary file by
    default, removed when :meth:`stop` ends a server that was still running; kept when it had died), not to a pipe
    that nobody would read once it has started; a server that fails to start raises RuntimeError with the end of
    that log. ``owned_paths`` (files or folders made for the server, such as its corpus
    file) are removed when it stops. Usable as a context manager.

    :meth:`exit_error` says whether it still runs (None) or why it is gone (its exit code or signal, and its log), by
    polling the process: a :class:`~trl_tree.envs.hotpot.RemoteRetriever` given it as ``server`` asks before every
    search, so a server that exits mid-run stops the run at the next search, not after retries have failed.
    """

    def __init__(
        self,
        server_args: list[str],
        startup_timeout: float = 600.0,
        log_path: str | os.PathLike | None = None,
        owned_paths: tuple[str | os.PathLike, ...] = (),
    ):
        self.server_args = list(server_args)
        self.owned_paths = [Path(path) for path in owned_paths]
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path is not None else None
        self._own_log = log_path is None
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self._stopped = False  # stop() ended it: its exit is this process's doing, not a failure

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "trl_tree.cli",
            "retrieval-server",
            *self.server_args,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ]

    def start(self) -> str:
        if self.process is not None:
            raise RuntimeError(f"The retrieval server was already started ({self.url}).")
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="trl-tree-retrieval-server-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        atexit.register(self.stop)
        try:
            self.url = self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def exit_error(self) -> str | None:
        """None while the server runs (or before it is started); else why it is gone: its exit code (or the signal
        that killed it) and where its log is, with the log's last lines."""
        if self.process is None:
            return None
        code = self.process.poll()
        if code is None:
            return None
        if self._stopped:
            return f"this run stopped its retrieval server (pid {self.process.pid}) at {self.url}"
        how = f"exited with code {code}"
        if code < 0:
            with contextlib.suppress(ValueError):
                how += f" (killed by {signal.Signals(-code).name})"
        tail = self.log_tail(10)
        return (
            f"the retrieval server this run started (pid {self.process.pid}, `{' '.join(self.command())}`) {how}. "
            f"Its log is {self.log_path}" + (f"; it ends with:\n{tail}" if tail else " (empty)")
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except (OSError, AttributeError):
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _ready_url(self) -> str | None:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        match = re.search(re.escape(READY_PREFIX) + r"(\S+)", text)
        return match.group(1) if match else None

    def _wait_until_ready(self) -> str:
        """The server's URL once it prints it and answers /health; RuntimeError if it exits or times out first."""
        import httpx

        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"The retrieval server ({' '.join(self.command())}) exited with code {code} before "
                    f"it was ready. Its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            url = self._ready_url()
            if url is not None:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                        return url
            time.sleep(0.1)
        raise RuntimeError(
            f"The retrieval server did not answer within {self.startup_timeout:.0f}s. Its log "
            f"({self.log_path}) ends with:\n{self.log_tail()}"
        )

    def stop(self, grace: float = 10.0) -> None:
        """End the server if it is running (idempotent)."""
        atexit.unregister(self.stop)
        process = self.process
        if process is not None and process.poll() is None:
            self._stopped = True
            process.terminate()
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if self._own_log:  # it ran until asked to stop: nothing in its log to keep
                self.log_path.unlink(missing_ok=True)
        for path in self.owned_paths:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self.owned_paths = []

    def __enter__(self) -> "RetrievalServerProcess":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


if __name__ == "__main__":
    raise SystemExit(main())
