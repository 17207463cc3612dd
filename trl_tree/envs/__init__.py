"""Environments for agentic RL: HotpotQA search (real or synthetic offline data)."""

from trl_tree.envs.hotpot import (
    BM25Retriever,
    DenseRetriever,
    RemoteRetriever,
    Retriever,
    SearchEnv,
    build_corpus,
    build_prompt,
    examples_to_dataset,
    format_passages,
    load_corpus,
    load_hotpot_dataset,
    load_hotpot_examples,
    make_search_tool,
    search_env_factory,
)
from trl_tree.envs.synthetic import make_synthetic_hotpot, scripted_search_conversation, synthetic_splits

__all__ = [
    "BM25Retriever",
    "DenseRetriever",
    "RemoteRetriever",
    "Retriever",
    "SearchEnv",
    "build_corpus",
    "build_prompt",
    "examples_to_dataset",
    "format_passages",
    "load_corpus",
    "load_hotpot_dataset",
    "load_hotpot_examples",
    "make_search_tool",
    "make_synthetic_hotpot",
    "scripted_search_conversation",
    "search_env_factory",
    "synthetic_splits",
]
