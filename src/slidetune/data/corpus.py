"""The built-in English corpus: prose that ships with CPython, so nothing is downloaded.

Two sources, each a list of documents:
  * ``pydoc_data.topics.topics``: the language reference / library topics that ``help()``
    shows (~0.47 MB, one document per topic);
  * docstrings of a fixed list of standard-library modules (module, class, function and
    method docstrings of at least ``MIN_DOC_CHARS`` characters, ~0.65 MB).
Together about 1.1 MB (~280K SmolLM2 tokens) of English. The text depends on the Python
version (docstrings change between releases) but is deterministic for a given one.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from types import ModuleType

# Shorter docstrings are mostly one-line summaries ("Return the sum of a and b."): they add
# little prose and, packed back to back, would make the corpus a list of fragments.
MIN_DOC_CHARS = 200

# Pure-Python (or thin-wrapper) standard-library modules that import without side effects
# (no I/O, no printing, no readline hooks; `this`, `antigravity`, `rlcompleter`, `pdb`,
# `turtle` and the modules deprecated for removal are left out on purpose). Sorted, fixed:
# the corpus must be the same in every process. A module missing from a given build of
# Python (ImportError) is skipped.
STDLIB_MODULES: tuple[str, ...] = tuple(sorted("""
    abc argparse ast asyncio base64 bdb bisect calendar cmd code codecs collections colorsys
    concurrent.futures configparser contextlib copy copyreg csv dataclasses datetime decimal
    difflib dis email email.message email.mime.text email.parser email.policy enum filecmp
    fileinput fnmatch fractions ftplib functools getopt getpass gettext glob graphlib gzip
    hashlib heapq hmac html html.parser http http.client http.cookiejar http.cookies
    http.server imaplib importlib importlib.metadata importlib.resources inspect io ipaddress
    json json.decoder json.encoder keyword linecache locale logging logging.handlers lzma
    mailbox mimetypes modulefinder multiprocessing netrc numbers opcode operator optparse os
    pathlib pickle pickletools pkgutil platform plistlib poplib posixpath pprint profile
    pstats py_compile pyclbr pydoc queue quopri random re reprlib runpy sched secrets
    selectors shelve shlex shutil smtplib socket socketserver stat statistics string
    stringprep struct subprocess symtable sysconfig tabnanny tarfile tempfile textwrap
    threading timeit token tokenize trace traceback tracemalloc types typing unittest
    unittest.mock urllib.parse urllib.request urllib.robotparser uuid warnings wave weakref
    xml.dom.minidom xml.etree.ElementTree xml.sax xmlrpc.client zipapp zipfile zipimport
    zoneinfo
""".split()))


def _getdoc(obj: object) -> str | None:
    try:
        return inspect.getdoc(obj)
    except Exception:  # a few descriptors raise on attribute access
        return None


def _module_docstrings(module: ModuleType) -> dict[str, str]:
    """{"module:Qual.name": docstring} for the module and what it defines itself."""
    name = module.__name__
    docs: dict[str, str | None] = {name: _getdoc(module)}
    for attr, obj in sorted(vars(module).items()):
        # Only objects defined here: re-exports would repeat another module's docstrings.
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != name:
            continue
        docs[f"{name}:{attr}"] = _getdoc(obj)
        if inspect.isclass(obj):
            for member_name, member in sorted(vars(obj).items()):
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member) or isinstance(member, property):
                    docs[f"{name}:{attr}.{member_name}"] = _getdoc(member)
    return {k: d for k, d in docs.items() if d is not None and len(d) >= MIN_DOC_CHARS}


def stdlib_docstrings() -> dict[str, str]:
    """{"module:Qual.name": docstring} of the standard-library modules in `STDLIB_MODULES` (those
    that import here), each at least `MIN_DOC_CHARS` long: the corpus's second source, and the
    answers of benchmarks/scripts/compact_quality.py's chat set."""
    docs: dict[str, str] = {}
    for mod_name in STDLIB_MODULES:
        # Importing some modules or reading some attributes (typing.io) warns of deprecation.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(mod_name)
            except ImportError:
                continue
            docs.update(_module_docstrings(module))
    return docs


@functools.lru_cache(maxsize=1)
def _builtin_corpus() -> tuple[str, ...]:
    from pydoc_data.topics import topics  # a plain dict: topic name -> text

    keyed: list[tuple[str, str]] = [(f"pydoc_data.topics:{k}", topics[k]) for k in sorted(topics)]
    stdlib = stdlib_docstrings()
    keyed += [(k, stdlib[k]) for k in sorted(stdlib)]
    seen: set[str] = set()
    docs: list[str] = []
    for _, text in keyed:
        text = text.strip()
        if text and text not in seen:  # inherited docstrings repeat verbatim
            seen.add(text)
            docs.append(text)
    return tuple(docs)


def builtin_corpus() -> list[str]:
    """The built-in English corpus as a list of documents, in a fixed order (no download).

    pydoc topics first (sorted by topic), then standard-library docstrings (sorted by
    ``module:qualname``), deduplicated. About 1.1 MB of text in ~1200 documents.
    """
    return list(_builtin_corpus())
