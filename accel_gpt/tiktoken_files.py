"""Are tiktoken's two GPT-2 BPE files at hand? `python3 -m accel_gpt.tiktoken_files` answers in seconds, before
anything is installed: `make test` runs it first (the tests use GPT-2's tokens), so a machine without internet and
without the files learns it at once, not after minutes of installing. `make quickstart` needs no GPT-2 files: its
tokenizer is learned from the text.

The files are looked for where tiktoken looks: TIKTOKEN_CACHE_DIR, else DATA_GYM_CACHE_DIR, else
`<temp folder>/data-gym-cache`, each named by the SHA-1 of its URL and taken only if its SHA-256 is the one tiktoken
expects (else tiktoken downloads it again). When one is missing, their host is asked (a HEAD request, a few seconds
at most, DNS included): if it answers, tiktoken downloads them on first use. Either way one line, exit 0. When
neither, one `error: ...` line that says what to do, exit 2 (the exit code of accel_gpt's other one-line errors).

Why a module of the package, not a script beside it: it belongs to accel_gpt (it checks for what tokenizer.py's GPT-2
encoding loads, and is installed with it), and `python3 -m accel_gpt.tiktoken_files` also runs from a clone with the
system python before any environment exists, since the current folder is on the path and the package's `__init__`
imports nothing. So it uses the standard library alone and imports nothing of accel_gpt: no torch, no tiktoken (a
test runs it without site-packages).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request

# tiktoken_ext/openai_public.py, gpt2(): the two URLs and the SHA-256 of their contents.
BASE = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
DESCRIPTION = "Whether tiktoken's GPT-2 BPE files are cached, or else their host answers (standard library only)."
TIMEOUT = 5.0  # seconds for the host to answer


def cached_name(name: str) -> str:
    """The file name tiktoken caches `name` under: the SHA-1 hex digest of its URL."""
    return hashlib.sha1((BASE + name).encode()).hexdigest()


def cache_dir() -> tuple[str, str]:
    """(folder, where that is, in words), by tiktoken's rules; folder '' when TIKTOKEN_CACHE_DIR is set empty, which
    turns tiktoken's cache off."""
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if variable in os.environ:
            folder = os.environ[variable]
            return folder, f"{variable}={folder}" if folder else f"no cache: {variable} is set empty"
    folder = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return folder, f"tiktoken's default cache {folder}, TIKTOKEN_CACHE_DIR being unset"


def missing(folder: str) -> list[str]:
    """The files that tiktoken would not take from `folder`: absent, unreadable or not the expected contents."""
    if not folder:
        return list(FILES)
    gone = []
    for name, sha256 in FILES.items():
        try:
            with open(os.path.join(folder, cached_name(name)), "rb") as f:
                ok = hashlib.sha256(f.read()).hexdigest() == sha256
        except OSError:
            ok = False
        if not ok:
            gone.append(name)
    return gone


def unreachable(url: str, timeout: float) -> str | None:
    """None when `url` answers within `timeout` seconds, else why not. The request runs in a thread that is waited for
    `timeout` seconds at most, since urllib's timeout does not bound the DNS lookup."""
    answer: list[str | None] = []

    def ask() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
                answer.append(None)
        except urllib.error.HTTPError as e:
            answer.append(f"HTTP {e.code}")
        except urllib.error.URLError as e:
            answer.append(str(getattr(e.reason, "strerror", None) or e.reason))
        except Exception as e:  # a timeout, a reset connection, a bad URL
            answer.append(str(e) or type(e).__name__)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    return answer[0] if answer else f"no answer in {timeout:g} s"


def check(probe: str, timeout: float) -> tuple[int, str]:
    """(exit code, the one line to print)."""
    folder, where = cache_dir()
    absent = missing(folder)
    if not absent:
        return 0, f"tiktoken's GPT-2 BPE files: in {where}"
    host = urllib.parse.urlsplit(probe).netloc or probe
    why = unreachable(probe, timeout)
    if why is None:
        return 0, f"tiktoken's GPT-2 BPE files: not cached ({where}), but {host} answers: tiktoken downloads them"
    if folder:
        damaged = [name for name in absent if os.path.exists(os.path.join(folder, cached_name(name)))]
        gone = [name for name in absent if name not in damaged]
        where = "; ".join(
            f"{' and '.join(names)} {state} {where}"
            for names, state in ((gone, "not in"), (damaged, "damaged in"))
            if names
        )
    names = " and ".join(f"{cached_name(name)} ({name})" for name in FILES)
    return 2, (
        f"error: tiktoken's GPT-2 BPE files are not at hand ({where}) and {host} cannot be reached ({why}): go "
        f"online, or save the two files of {BASE} in a folder as {names}, or copy a tiktoken cache folder that holds "
        "them, and set TIKTOKEN_CACHE_DIR to that folder"
    )


class _Parser(argparse.ArgumentParser):
    """Bad arguments as one `error:` line, exit 2, like accel_gpt's other commands."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 600:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds in (0, 600]")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m accel_gpt.tiktoken_files", description=DESCRIPTION)
    parser.add_argument(
        "--probe",
        default=BASE + "vocab.bpe",
        help="the address asked when the files are missing (default: %(default)s)",
    )
    wait = "seconds to wait for it (default: %(default)s)"
    parser.add_argument("--timeout", type=seconds, default=TIMEOUT, help=wait)
    args = parser.parse_args(argv)
    code, line = check(args.probe, args.timeout)
    print(line, file=sys.stderr if code else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
