"""Shared test settings: one thread per process (ranks are forked from the test process), and the megatron CPU
shims, asked for here explicitly (importing the package patches nothing; on a machine with CUDA they refuse, so
they are not asked for there).

Markers (registered in pyproject.toml; `make test-fast` deselects the first two):
  distributed  forks ranks (megatron_2d.testing.distributed.run_on_ranks) or starts torchrun / process groups;
  megatron     builds a Megatron model, runs Megatron-LM's training entry or parses its command line.
A test that forks ranks without the `distributed` marker fails at once (see _ranks_refused_unless_marked), so the
fast set cannot silently gain a multi-rank test."""

import contextlib
import gc
import json

import pytest
import torch

from megatron_2d.testing import distributed as _distributed
from megatron_2d_dev import leftovers as _leftovers
from megatron_2d_dev.megatron_cpu import install_megatron_cpu_shims
from megatron_2d_dev.sft_data import PROMPT_FORMAT, write_sft_conversations, write_sft_tokenizer

torch.set_num_threads(1)

if not torch.cuda.is_available():
    install_megatron_cpu_shims(import_training=True)  # megatron.training needs typing.override on Python 3.11


class _RanksRefused:
    """Stands in for ``multiprocessing`` inside megatron_2d.testing.distributed while a test without the
    ``distributed`` marker runs: forking ranks fails the test with the fix in the message."""

    def __init__(self, nodeid):
        self.nodeid = nodeid

    def get_context(self, method=None):
        pytest.fail(
            f"{self.nodeid} forks ranks (run_on_ranks) but is not marked `distributed`: add "
            "@pytest.mark.distributed (or a module-level pytestmark) so `make test-fast` leaves it out",
            pytrace=False,
        )


@contextlib.contextmanager
def _ranks_refused_unless_marked(item):
    if item.get_closest_marker("distributed") is not None:
        yield
        return
    saved = _distributed.mp
    _distributed.mp = _RanksRefused(item.nodeid)
    try:
        yield
    finally:
        _distributed.mp = saved


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):  # module-scoped fixtures (e.g. `results`) fork ranks during setup
    with _ranks_refused_unless_marked(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _ranks_refused_unless_marked(item):
        yield


def pytest_collection_finish(session):
    """What exists once the test modules are imported (torch, megatron, the tests' own tables: ~1 GB of objects that
    live as long as the session) is moved out of the collector's reach: a full collection then scans only what the
    tests made since (it scanned the whole heap: about a fifth of `make test-fast`'s time)."""
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # back in the collector's reach for the interpreter's exit (nanobind lists what it did not free)


_LEFTOVERS = pytest.StashKey[_leftovers.Session]()


def pytest_sessionstart(session):
    """From here on, what the session creates is its own (temporary root, process tree, namespace ledger):
    megatron_2d_dev.leftovers."""
    session.config.stash[_LEFTOVERS] = _leftovers.start_session()


def pytest_sessionfinish(session, exitstatus):
    """The run fails if it left temporary files, processes or network namespaces behind (its own only: nothing that
    other work on the machine made meanwhile is counted or touched); what it left is listed, then removed."""
    started = session.config.stash.get(_LEFTOVERS, None)
    if started is None:
        return
    problems = _leftovers.finish_session(started)
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["the test run left behind (removed now):", *problems]
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line("\n" + "\n  ".join(lines), red=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="module")
def sft_corpus(tmp_path_factory):
    """The flags naming the tiny tokenizer and jsonl of megatron_2d_dev.sft_data (for Megatron's --sft route).
    The forked ranks inherit an offline Hugging Face with its datasets cache in tmp. (``datasets`` is imported in the
    ranks, not here: pyarrow starts a jemalloc thread at import, and the ranks are forked from this process.)"""
    root = tmp_path_factory.mktemp("sft")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_CACHE", str(root / "hf_datasets"))
        env.setenv("TOKENIZERS_PARALLELISM", "false")
        corpus = {
            "--tokenizer-model": write_sft_tokenizer(root / "tokenizer"),
            "--data-path": write_sft_conversations(root / "sft.jsonl"),
        }
        check_sft_corpus(corpus["--tokenizer-model"], corpus["--data-path"])
        yield [item for flag, path in corpus.items() for item in (flag, str(path))]


def check_sft_corpus(tokenizer_dir, data_path, seq_length=128, cp_size=4):
    """What the SFT tests rely on, as Megatron's SFTTokenizer renders it: every sample packs several conversations,
    some answers are one token, and no conversation is truncated at CP=1 or at ``cp_size`` (SFTDataset pads each
    one to a multiple of 2 * CP there)."""
    from megatron.core.tokenizers.text.libraries.sft_tokenizer import SFTTokenizer

    tokenizer = SFTTokenizer(str(tokenizer_dir), PROMPT_FORMAT)
    one_token_answers = 0
    for line in data_path.read_text().splitlines():
        messages = json.loads(line)["messages"]
        starts = [i for i, m in enumerate(messages) if m["role"] == "system"] + [len(messages)]
        assert len(starts) >= 3, f"one conversation only: {messages}"
        padded = 0
        for begin, end in zip(starts, starts[1:]):
            tokens, _ = tokenizer.tokenize_conversation(
                messages[begin:end], return_target=True, add_generation_prompt=False
            )
            padded += -(-len(tokens) // (2 * cp_size)) * 2 * cp_size
        assert padded <= seq_length, f"{padded} tokens at CP={cp_size}: {messages}"
        one_token_answers += sum(
            m["role"] == "assistant" and len(tokenizer.text_to_ids(m["content"])) == 1 for m in messages
        )
    assert one_token_answers >= 5
