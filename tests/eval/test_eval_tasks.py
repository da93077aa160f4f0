"""Task builders: deterministic, real targets, the recall constraints, left truncation.

The byte-level fallback tokenizer maps byte b to id b, so ``bytes(ids)`` is the exact text."""

from __future__ import annotations

import builtins
import keyword
import re

import pytest
from eval_helpers import SMALL, stdlib_corpus, tokenizer

from herald.eval.line_targets import first_use_candidates, line_candidates
from herald.eval.line_task import import_statements
from herald.eval.recall_task import eligible_identifier
from herald.eval.sources import Corpus, SourceFile
from herald.eval.tasks import TaskConfig, build_examples, selection_hash


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus()


@pytest.fixture(scope="module")
def line_ex(corpus, tok):
    return build_examples("line", corpus, tok, 1024, 6, SMALL)


@pytest.fixture(scope="module")
def recall_ex(corpus, tok):
    return build_examples("recall", corpus, tok, 384, 6, SMALL)


def test_builders_are_deterministic(tok, line_ex, recall_ex):
    fresh = Corpus(codec=tok)
    again = build_examples("line", fresh, tok, 1024, 6, SMALL)
    assert selection_hash(again) == selection_hash(line_ex)
    assert [e.meta for e in again] == [e.meta for e in line_ex]
    again = build_examples("recall", fresh, tok, 384, 6, SMALL)
    assert selection_hash(again) == selection_hash(recall_ex)
    other_seed = build_examples(
        "line", fresh, tok, 1024, 6, TaskConfig(**{**SMALL.__dict__, "seed": 1})
    )
    assert selection_hash(other_seed) != selection_hash(line_ex)


def test_line_targets_are_real_lines_and_same_at_every_context(corpus, tok, line_ex):
    assert len(line_ex) == 6
    for ex in line_ex:
        raw = (corpus.root / ex.meta["file"]).read_bytes()
        f = corpus.read(ex.meta["file"])
        assert f.sha256 == ex.meta["sha256"]
        assert raw.decode().split("\n")[ex.meta["line"] - 1].rstrip("\r") == ex.target
        stripped = ex.target.strip()
        assert 10 <= len(stripped) <= 160 and not stripped.startswith(("#", '"', "'", "import "))
        assert stripped not in {line.strip() for line in f.lines[: ex.meta["line"] - 1]}
    # Paired across contexts: the same targets at a shorter context.
    short = build_examples("line", corpus, tok, 256, 6, SMALL)
    assert [(e.meta["file"], e.meta["line"]) for e in short] == [
        (e.meta["file"], e.meta["line"]) for e in line_ex
    ]


def check_infile_layout(f, ex, infile: bytes, cap: int) -> None:
    """A cut in-file part: the header, whole import statements of the file in order (at most
    half the cap with the header, none repeated in the kept code), then the prefix's tail."""
    header = f"# file: {f.rel}\n".encode()
    n_in = ex.meta["infile_tokens"]
    part = bytes(ex.prompt_ids[-n_in:])
    assert part.startswith(header)
    imports = part[len(header) : len(header) + ex.meta["import_tokens"]]
    assert not imports or len(header) + len(imports) <= cap // 2
    used = []  # whole statements, in file order
    rest = imports
    for st in (st.encode() for st in import_statements(f, ex.meta["line"])):
        if rest.startswith(st):
            used.append(st)
            rest = rest[len(st) :]
    assert rest == b""
    tail = part[len(header) + len(imports) :]
    assert infile.endswith(tail) and len(tail) == n_in - len(header) - len(imports)
    assert not any(st in tail for st in used)  # not repeated in the kept code


def test_line_prompt_keeps_the_infile_prefix_and_truncates_context_left(corpus, line_ex):
    for ex in line_ex:
        f = corpus.read(ex.meta["file"])
        infile = (f"# file: {f.rel}\n" + "".join(f.lines[: ex.meta["line"] - 1])).encode()
        # The prompt stops before the newline that precedes the target (and any blank lines):
        # the model writes the newline-and-indentation token (one BPE token) itself.
        infile = infile.rstrip()
        assert not bytes(ex.prompt_ids[-1:]).isspace()
        n_in = ex.meta["infile_tokens"]
        assert n_in == min(len(infile), 64)
        assert len(ex.prompt_ids) == 1024  # stdlib packages are far longer than 1K bytes
        if ex.meta["infile_truncated"]:  # the header, imports that fit, the prefix's tail
            check_infile_layout(f, ex, infile, cap=64)
        else:
            assert ex.meta["import_tokens"] == 0
            assert bytes(ex.prompt_ids[-n_in:]) == infile  # the in-file prefix, kept
        # The rest is the tail of the related files' chunks, most related last.
        files = ex.meta["context_files"]
        chunks = b"".join(corpus.read(c["file"]).chunk().encode() for c in files)
        ctx = bytes(ex.prompt_ids[:-n_in])
        assert chunks.endswith(ctx) and len(ctx) == 1024 - n_in
        assert not any(c["truncated"] for c in files[1:])
        ranks = [corpus.relatedness(f.rel, c["file"]) for c in files]
        assert ranks == sorted(ranks)
        assert all(c["file"] != f.rel for c in files)


def test_line_candidates_prefer_cross_file_names(corpus):
    f = corpus.read("json/decoder.py")
    cands = line_candidates(f, {"scanstring"}, set())
    rows = [r for r, tier in cands if tier == 2]
    assert rows and all("scanstring" in f.lines[r - 1] for r in rows)
    # An attribute of the same name is not a use of the imported name.
    from herald.eval.sources import SourceFile

    text = "import os\n\n\nclass P:\n    def f(self):\n        self.wait(timeout=1)\n"
    text += "        return wait(self, timeout=2)\n"
    g = SourceFile("p.py", text, "0")
    assert dict(line_candidates(g, {"wait"}, set())) == {5: 0, 6: 0, 7: 2}


def test_cross_file_first_targets_first_use_a_name_absent_from_the_control_window(corpus, line_ex):
    for ex in line_ex:
        assert ex.meta["setting"] == "cross_file_first" and ex.meta["names"]
        window = bytes(ex.prompt_ids[-SMALL.control_tokens :]).decode(errors="replace")
        for name in ex.meta["names"]:
            assert re.search(rf"\b{name}\b", ex.target)
            assert not re.search(rf"\b{name}\b", window)
            f = corpus.read(ex.meta["file"])
            above = f.lines[: ex.meta["line"] - 1]  # imported above (module level or local)
            imports = [ln for ln in above if ln.lstrip().startswith(("import ", "from "))]
            assert any(re.search(rf"\b{name}\b", ln) for ln in imports) or re.search(
                rf"import \([^)]*\b{name}\b", "".join(above)
            )


def test_first_use_candidates_and_import_statements():
    text = (
        "import os\n"
        "from .a import (x,\n"
        "    y)\n"
        "try:\n"
        "    from .b import z\n"
        "except ImportError:\n"
        "    z = None\n"
        "\n"
        "def f():\n"
        "    import json\n"
        "    q = obj.x + 1\n"  # an attribute: not a use of x
        "    return x(y)\n"  # first use of x and y
        "v = x(2) + z.w\n"  # x again; first use of z (line 7 binds it, it does not read it)
        "from .c import late\n"
    )
    g = SourceFile("p/m.py", text, "0")
    # Module-level statements only (a nested import shown out of its block is not valid code).
    assert import_statements(g, 99) == [
        "import os\n",
        "from .a import (x,\n    y)\n",
        "from .c import late\n",
    ]
    assert import_statements(g, 14) == import_statements(g, 99)[:2]  # only those above the row
    assert first_use_candidates(g, {"x", "y", "z", "late"}) == [(12, ["x", "y"]), (13, ["z"])]


def test_first_use_is_a_read_of_a_name_imported_above():
    text = (
        "import os\n"
        "import sys\n"
        "import json\n"
        "\n"
        "def show_compilers():\n"  # binds the name, before its (local) import
        "    from p.ccompiler import show_compilers\n"
        "    show_compilers()\n"  # the first read, after the local import
        "\n"
        "class Queue(object):\n"
        "    def __init__(self, maxsize=0, *, ctx):\n"  # a parameter: a binding
        "        from .synchronize import SEM_VALUE_MAX as maxsize\n"
        "        self.maxsize = maxsize + 0\n"  # the first read of maxsize
        "    def later(self):\n"
        "        return helper(self.maxsize)\n"  # helper is imported only below
        "from .util import helper\n"
    )
    g = SourceFile("p/m.py", text, "0")
    cross = {"show_compilers", "maxsize", "helper"}
    assert first_use_candidates(g, cross) == [(7, ["show_compilers"]), (12, ["maxsize"])]
    # Tiers count reads too: a def of an imported name is not a tier-2 line.
    tiers = dict(line_candidates(g, cross, set()))
    assert tiers[10] == 0 and tiers[12] == 2 and tiers[14] == 2


def test_line_prompt_holds_the_files_imports(corpus, tok):
    cfg = TaskConfig(**{**SMALL.__dict__, "infile_tokens": 400})
    exs = build_examples("line", corpus, tok, 1024, 6, cfg)
    assert sum(ex.meta["import_tokens"] > 0 for ex in exs) >= 3
    for ex in exs:
        f = corpus.read(ex.meta["file"])
        infile = (f.header + "".join(f.lines[: ex.meta["line"] - 1])).encode().rstrip()
        if ex.meta["infile_truncated"]:
            check_infile_layout(f, ex, infile, cap=400)
        else:
            assert bytes(ex.prompt_ids[-ex.meta["infile_tokens"] :]) == infile


def test_later_use_candidates_are_uses_after_the_first():
    from herald.eval.line_targets import first_use_candidates, later_use_candidates
    from herald.eval.sources import SourceFile

    text = "from .a import wait, go\n\n\ndef f(x):\n    y = wait(x, 1)\n    z = wait(x, 2)\n"
    text += "    w = wait(go(x), 3)\n    return wait(go(y))\n"
    g = SourceFile("p.py", text, "0")
    assert first_use_candidates(g, {"wait", "go"}) == [(5, ["wait"]), (7, ["go"])]
    # row 7 also first-reads go: not a later use; row 8 reads both again
    assert later_use_candidates(g, {"wait", "go"}) == [(6, ["wait"]), (8, ["go", "wait"])]


def test_cross_file_later_targets_a_later_use_absent_from_the_control_window(corpus, tok):
    cfg = TaskConfig(**{**SMALL.__dict__, "line_setting": "cross_file_later"})
    examples = build_examples("line", corpus, tok, 1024, 4, cfg)
    assert len(examples) == 4
    for ex in examples:
        assert ex.meta["setting"] == "cross_file_later" and ex.meta["names"]
        window = bytes(ex.prompt_ids[-SMALL.control_tokens :]).decode(errors="replace")
        f = corpus.read(ex.meta["file"])
        above = "".join(f.lines[: ex.meta["line"] - 1])
        for name in ex.meta["names"]:
            assert re.search(rf"\b{name}\b", ex.target)
            assert not re.search(rf"\b{name}\b", window)
            # used (not only imported) above the target
            uses = [ln for ln in f.lines[: ex.meta["line"] - 1] if re.search(rf"\b{name}\b", ln)]
            assert any(not ln.lstrip().startswith(("import ", "from ")) for ln in uses), above


def test_line_settings(corpus, tok):
    cfg = TaskConfig(**{**SMALL.__dict__, "line_setting": "cross_file_random"})
    ex = build_examples("line", corpus, tok, 1024, 4, cfg)
    assert len(ex) == 4 and all(e.meta["setting"] == "cross_file_random" for e in ex)
    assert all(e.meta["tier"] in (0, 1, 2) for e in ex)
    with pytest.raises(ValueError, match="line setting"):
        build_examples("line", corpus, tok, 1024, 1, TaskConfig(line_setting="nope"))


def test_cross_file_random_finds_each_files_candidates_once(corpus, tok, monkeypatch):
    """A build visits files many times; their candidate lines are computed once per build
    (tokenizing and walking a file at every visit made 1,000-example builds minutes long)."""
    import herald.eval.line_task as line_task

    calls: list[str] = []
    real = line_task.line_candidates

    def counting(f, cross, package):
        calls.append(f.rel)
        return real(f, cross, package)

    monkeypatch.setattr(line_task, "line_candidates", counting)
    cfg = TaskConfig(**{**SMALL.__dict__, "line_setting": "cross_file_random"})
    ex = build_examples("line", corpus, tok, 1024, 40, cfg)
    assert len(ex) == 40 and len(calls) == len(set(calls))
    targets = [(e.meta["file"], e.meta["line"]) for e in ex]
    assert len(set(targets)) == len(targets)  # the cache never hands out a chosen line again


@pytest.mark.parametrize("seed", [0, 7])
def test_cross_file_random_cache_builds_what_the_uncached_reference_builds(
    corpus, tok, monkeypatch, seed
):
    """The reference: every visit recomputes the file's candidates (a fresh cache per call)."""
    import herald.eval.line_task as line_task

    cfg = TaskConfig(**{**SMALL.__dict__, "line_setting": "cross_file_random", "seed": seed})
    cached = build_examples("line", corpus, tok, 1024, 30, cfg)
    real = line_task._pick_random_use

    def uncached(*args):
        return real(*args[:-1], {})

    monkeypatch.setattr(line_task, "_pick_random_use", uncached)
    reference = build_examples("line", corpus, tok, 1024, 30, cfg)
    assert selection_hash(cached) == selection_hash(reference)
    assert [e.meta for e in cached] == [e.meta for e in reference]


def test_recall_constraints(corpus, tok, recall_ex):
    assert len(recall_ex) == 6
    for ex in recall_ex:
        m = ex.meta
        f = corpus.read(m["file"])
        name = ex.target
        assert eligible_identifier(name)
        assert not keyword.iskeyword(name) and not hasattr(builtins, name)
        # The definition line defines it; the use is that identifier, later.
        assert re.search(rf"\b{name}\b", f.lines[m["def_line"] - 1])
        off = f.line_offsets[m["line"] - 1] + m["col"]
        assert re.match(rf"{name}\b", f.text[off:])
        # The prompt ends just before the use (trailing spaces dropped).
        head = f.text[:off].rstrip(" \t").encode()
        assert head.endswith(bytes(ex.prompt_ids[-200:]))
        # Distance (definition line -> use) in tokens, inside the prompt.
        dist = len(tok.encode(f.text[f.line_offsets[m["def_line"] - 1] : off].rstrip(" \t")))
        assert dist == m["distance_tokens"] and SMALL.min_distance <= dist <= 384 - 64
        assert f.lines[m["def_line"] - 1].encode() in bytes(ex.prompt_ids)
        # Absent from the control window.
        assert not re.search(rf"\b{name}\b", tok.decode(ex.prompt_ids[-SMALL.control_tokens :]))
        assert len(ex.prompt_ids) <= 384


def test_recall_rejects_bad_sizes(corpus, tok):
    with pytest.raises(ValueError, match="min_distance"):
        build_examples(
            "recall", corpus, tok, 4096, 1, TaskConfig(control_tokens=512, min_distance=100)
        )
    with pytest.raises(ValueError, match="context"):
        build_examples("recall", corpus, tok, 1000, 1, TaskConfig())
    with pytest.raises(ValueError, match="unknown task"):
        build_examples("nope", corpus, tok, 1000, 1, TaskConfig())


def test_prompts_end_at_token_boundaries_of_the_bpe_tokenizer():
    """With the trained model's byte-level BPE, a recall prompt ending in ``self.`` before
    ``_name`` (``._`` is one token) or in a bare newline before an indented line (newline and
    indentation are one token) ends inside a token: such uses are not eligible."""
    from tokenizers import Tokenizer as HFTokenizer

    from herald.eval.line_task import line_prompt_text
    from herald.eval.recall_task import ends_at_token_boundary
    from herald.eval.sources import SourceFile
    from herald.models.loader import bundled_checkpoint

    bpe = HFTokenizer.from_file(str(bundled_checkpoint("code-sdar") / "tokenizer.json"))

    class Codec:
        def encode(self, text):
            return bpe.encode(text).ids

        def decode(self, ids):
            return bpe.decode(ids)

    text = "class A:\n    def f(self):\n        return self._cache.get(key)\n"
    f = SourceFile("a.py", text, "0")
    row = 3
    use = text.index("_cache")
    assert not ends_at_token_boundary(Codec(), f, row, use)  # "self." | "_cache": inside "._"
    call = text.index("get(key)")
    assert ends_at_token_boundary(Codec(), f, row, call)  # "self._cache." | "get"
    line3 = f.line_offsets[row - 1]
    assert not ends_at_token_boundary(Codec(), f, row, line3)  # bare "\n" before 8 spaces
    # The line task's prompt ends at the last non-blank character above the target: a boundary.
    assert line_prompt_text(f, row).endswith("def f(self):")
    assert ends_at_token_boundary(Codec(), f, row, line3 - 1)


def _write_package(root, name: str, files: int, lines: int) -> None:
    """A package of ``files`` modules of ``lines`` distinct eligible target lines each."""
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""' + name + " package." + " " * 400 + '"""\n')
    for i in range(files):
        body = [f'"""Module {i} of {name}."""', "import os", "", "", "def run():"]
        body += [f"    value_{i}_{j} = os.getcwd() + '{j}'" for j in range(lines)]
        body.append("    return None")
        (pkg / f"mod{i}.py").write_text("\n".join(body) + "\n")


def test_cross_file_random_asks_every_eligible_line_before_it_stops(tmp_path, tok):
    """A small package running out early must not end the build while another still has lines
    (the build once stopped after 4 misses per package in all, at about 4,750 of the ~48,000
    16K targets of Python 3.11's library); and a smaller build is a prefix of a larger one."""
    _write_package(tmp_path, "small", files=3, lines=2)
    _write_package(tmp_path, "large", files=3, lines=60)
    corpus = Corpus(tmp_path, codec=tok)
    eligible = 0
    for files in corpus.packages.values():
        for rel in files:
            f = corpus.read(rel)
            assert f is not None and f.tree is not None
            eligible += len(line_candidates(f, set(), set()))
    assert eligible > 3 * 60
    cfg = TaskConfig(
        **{**SMALL.__dict__, "line_setting": "cross_file_random", "min_package_chars": 100}
    )
    everything = build_examples("line", corpus, tok, 1024, 10 * eligible, cfg)
    targets = {(e.meta["file"], e.meta["line"]) for e in everything}
    assert len(targets) == len(everything) == eligible
    some = build_examples("line", corpus, tok, 1024, 50, cfg)
    assert selection_hash(some) == selection_hash(everything[:50])
