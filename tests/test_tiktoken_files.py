"""`python -m accel_gpt.tiktoken_files`, the check that `make test` runs before setting up: with
tiktoken's GPT-2 files cached, or their host answering, it passes in one line; with neither it fails in one line that
says what to do, within seconds, before anything is installed.

The check runs as `make` runs it before any environment exists: a separate interpreter without site-packages (`-S`),
so it imports neither torch nor tiktoken. The host is a local address (a closed port, a socket that never answers,
a small HTTP server), so these tests need no network and give the same answer online and offline.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from accel_gpt import tiktoken_files
from tests.conftest import REPO

CHECK = [sys.executable, "-S", "-m", "accel_gpt.tiktoken_files"]
# Where tiktoken caches vocab.bpe and encoder.json: the SHA-1 of their URLs, as in a cache folder tiktoken wrote.
NAMES = {
    "vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
    "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6",
}
PROXIES = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}


def offline_env(cache: Path, **extra: str) -> dict[str, str]:
    """This environment with `cache` as tiktoken's cache, no proxy (urllib would send a local address to one) and no
    outer make's settings (a sub-make prints 'Entering directory')."""
    drop = {"TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR", "MAKEFLAGS", "MAKELEVEL", "MFLAGS"}  # a make above the tests
    env = {k: v for k, v in os.environ.items() if k.lower() not in PROXIES and k not in drop}
    env.update(TIKTOKEN_CACHE_DIR=str(cache), **extra)
    return env


def run_check(cache: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """The check's result and how long it took, in seconds."""
    start = time.monotonic()
    proc = subprocess.run([*CHECK, *args], cwd=REPO, env=offline_env(cache), capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


def closed_port() -> int:
    """A local port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def silent_host() -> Iterator[str]:
    """A URL whose host takes the connection and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        yield f"http://127.0.0.1:{s.getsockname()[1]}/vocab.bpe"


@contextlib.contextmanager
def answering_host() -> Iterator[str]:
    """A URL whose host answers a HEAD request with 200, as the real host does."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/vocab.bpe"
        finally:
            server.shutdown()


@pytest.fixture
def cached(tmp_path: Path) -> Path:
    """A folder with the two files as tiktoken caches them, copied from the cache this environment loads them from."""
    tiktoken = pytest.importorskip("tiktoken")
    tiktoken.get_encoding("gpt2")  # cached here, or downloaded into the cache now
    source, where = tiktoken_files.cache_dir()
    if not source or tiktoken_files.missing(source):
        pytest.skip(f"tiktoken's GPT-2 files are not in a cache folder here ({where})")
    folder = tmp_path / "cache"
    folder.mkdir()
    for name in NAMES.values():
        shutil.copy(Path(source) / name, folder / name)
    return folder


def test_the_files_are_the_ones_tiktoken_loads_for_gpt2() -> None:
    """The URLs and SHA-256 sums are tiktoken's own (read from its source, since the check may not import it), and
    each file's cached name is the SHA-1 of its URL."""
    source = (Path(pytest.importorskip("tiktoken_ext.openai_public").__file__)).read_text()
    gpt2 = source[source.index("def gpt2(") :].split("\ndef ", 1)[0]
    for name, key in (("vocab.bpe", "vocab_bpe"), ("encoder.json", "encoder_json")):
        assert re.search(rf'{key}_file="{re.escape(tiktoken_files.BASE + name)}"', gpt2), name
        assert re.search(rf'{key}_hash="{tiktoken_files.FILES[name]}"', gpt2), name
        assert tiktoken_files.cached_name(name) == NAMES[name]


def test_without_the_files_and_offline_it_fails_in_one_line_within_seconds(tmp_path: Path) -> None:
    proc, seconds = run_check(tmp_path, "--probe", f"http://127.0.0.1:{closed_port()}/vocab.bpe")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(
        f"error: tiktoken's GPT-2 BPE files are not at hand (vocab.bpe and encoder.json not in "
        f"TIKTOKEN_CACHE_DIR={tmp_path}) and 127.0.0.1:"
    ), line
    assert "cannot be reached (" in line and "go online" in line and "set TIKTOKEN_CACHE_DIR to that folder" in line
    assert f"{NAMES['vocab.bpe']} (vocab.bpe) and {NAMES['encoder.json']} (encoder.json)" in line
    assert seconds < 10


def test_a_host_that_never_answers_costs_the_timeout_and_no_more(tmp_path: Path) -> None:
    with silent_host() as url:
        proc, seconds = run_check(tmp_path, "--probe", url, "--timeout", "1")
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "cannot be reached (" in proc.stderr
    assert seconds < 6


def test_with_the_files_or_their_host_it_passes_in_one_line(cached: Path, tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{closed_port()}/vocab.bpe"
    proc, _ = run_check(cached, "--probe", closed)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0,
        f"tiktoken's GPT-2 BPE files: in TIKTOKEN_CACHE_DIR={cached}\n",
        "",
    )

    (cached / NAMES["encoder.json"]).write_text("{}")  # tiktoken would download a file that is not what it expects
    proc, _ = run_check(cached, "--probe", closed)
    assert proc.returncode == 2 and f"(encoder.json damaged in TIKTOKEN_CACHE_DIR={cached})" in proc.stderr

    with answering_host() as url:
        proc, _ = run_check(tmp_path / "empty", "--probe", url)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert (
        proc.stdout.startswith("tiktoken's GPT-2 BPE files: not cached (TIKTOKEN_CACHE_DIR=")
        and "answers" in proc.stdout
    )


def test_make_test_stops_before_installing_anything(tmp_path: Path) -> None:
    """Without the files and offline (here: a proxy that refuses every connection, which urllib honours as tiktoken's
    requests would), `make test` prints the check's one line and stops, before it makes a virtual environment. (The
    quick start needs no GPT-2 files: its tokenizer is learned from the text.)"""
    if shutil.which("make") is None or shutil.which("python3") is None:
        pytest.skip("needs make and python3")
    proxy = f"http://127.0.0.1:{closed_port()}"
    env = offline_env(tmp_path / "empty", https_proxy=proxy, http_proxy=proxy)
    env.pop("VIRTUAL_ENV", None)
    venv = tmp_path / "venv"
    start = time.monotonic()
    proc = subprocess.run(
        ["make", "test", f"VENV={venv}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    seconds = time.monotonic() - start
    assert proc.returncode != 0 and proc.stdout == "", (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("error: tiktoken's GPT-2 BPE files are not at hand (vocab.bpe and encoder.json"), lines
    assert all(line.startswith("make") for line in lines[1:]), lines  # make's own "*** [Makefile:N: tiktoken] Error 2"
    assert not venv.exists()
    assert seconds < 30


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--timeout", "inf"], "argument --timeout: inf is not a number of seconds in (0, 600]"),
        (["--timeout", "nan"], "argument --timeout: nan is not a number of seconds in (0, 600]"),
        (["--timeout", "0"], "argument --timeout: 0 is not a number of seconds in (0, 600]"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path: Path, args: list[str], said: str) -> None:
    proc, _ = run_check(tmp_path / "empty", *args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == f"error: {said} (see `python -m accel_gpt.tiktoken_files --help`)\n"
