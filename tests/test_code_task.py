"""The code-completion task's judging rules: which functions are eligible, where a body ends, what parses."""

import textwrap

from hypothesis import given
from hypothesis import strategies as st

from blockpress.tasks.code import (
    Function,
    completion_parses,
    cut_body,
    fills_the_line,
    functions_in,
    heldout_functions,
    infill_cases,
    space_infill_cases,
)

SOURCE = textwrap.dedent('''\
    import os


    def one_liner(x): return x


    class Box:
        def __init__(self, items):
            self.items = list(items)
            self.size = len(self.items)

        def short(self):
            return 1

    async def fetch(url):
        data = await get(url)
        return data.decode()
''')


def test_functions_in_keeps_multiline_bodies_with_their_context():
    found = {f.header.strip(): f for f in functions_in(SOURCE, "m.py")}
    assert set(found) == {"def __init__(self, items):", "async def fetch(url):"}  # one-liners and 1-line bodies out
    init = found["def __init__(self, items):"]
    assert init.prefix.endswith(init.header) and "class Box:" in init.prefix
    assert init.body == "        self.items = list(items)\n        self.size = len(self.items)\n"
    assert init.indent == 4 and found["async def fetch(url):"].indent == 0
    assert init.prompt_text + "\n" == init.prefix  # the model writes the newline (and indentation) itself
    assert functions_in("def broken(:\n", "b.py") == []


def test_heldout_functions_is_a_seeded_shuffle(tmp_path):
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(SOURCE)
    first = heldout_functions(tmp_path, ["a.py", "b.py", "missing.py"], seed=3)
    assert len(first) == 4 and first == heldout_functions(tmp_path, ["a.py", "b.py"], seed=3)
    assert {f.module for f in first} == {"a.py", "b.py"}
    # shuffled by the seed: a benchmark's first N are not the first modules' first functions
    (tmp_path / "m.py").write_text("".join(f"def f{i}(a):\n    b = a\n    return b\n\n" for i in range(30)))
    orders = [[f.header for f in heldout_functions(tmp_path, ["m.py"], seed=s)] for s in (0, 1)]
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])
    assert orders[0] != [f.header for f in functions_in((tmp_path / "m.py").read_text(), "m.py")]


def test_cut_body_stops_at_dedent_or_at_the_last_complete_line():
    completion = "        x = 1\n\n        return x\n    def other(self):\n        pass\n"
    assert cut_body(completion, 4) == "        x = 1\n\n        return x"
    assert cut_body("        x = 1\n        y = (", 4) == "        x = 1"  # the unfinished last line is dropped


def test_parses_needs_a_statement_and_valid_syntax():
    header = "    def f(self):\n"
    assert completion_parses(Function("m", header, header, ""), "        return self.x\n")
    assert not completion_parses(Function("m", header, header, ""), "        return (self.x\n        y\n")
    assert not completion_parses(Function("m", header, header, ""), "        # only a comment\n")
    assert not completion_parses(Function("m", header, header, ""), "no newline at all")


@given(st.lists(st.sampled_from(["x = 1", "y = x + 2", "return y", "if x:", "pass", "print((x)"]), max_size=6))
def test_cut_body_never_keeps_a_line_at_or_above_the_def_indent(lines):
    completion = "".join(f"        {line}\n" for line in lines) + "    def g(self):\n        pass\n"
    body = cut_body(completion, 4)
    assert all(not line.strip() or line.startswith("        ") for line in body.split("\n"))
    assert "def g" not in body


class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_a_body_that_loops_parses_but_is_not_counted_by_the_strict_reading():
    from blockpress.tasks.code import (
        Function,
        completion_parses,
        completion_parses_without_loops,
        repeats_a_line,
    )

    f = Function(module="m", prefix="def f(self, attrs):", header="def f(self, attrs):", body="")
    loop = "\n    self.attrs = attrs\n    self.attrs = attrs\n    self.attrs = attrs\n"
    fine = "\n    self.attrs = attrs\n    self.name = None\n    return None\n"
    assert completion_parses(f, loop) and not completion_parses_without_loops(f, loop)
    assert completion_parses(f, fine) and completion_parses_without_loops(f, fine)
    assert not repeats_a_line("    pass\n    pass\n    pass\n")  # short lines repeat in real code
    assert repeats_a_line("a = compute(x)\nb = 1\na = compute(x)\n   a = compute(x)\n")


def test_infill_cases_hole_is_one_body_line_and_fits_the_canvas():
    funcs = functions_in(SOURCE, "m.py")
    cases = infill_cases(funcs, CharTokenizer(), canvas=64, limit=10, seed=0)
    assert cases
    for case in cases:
        assert "".join(map(chr, case.hole)) == "\n" + case.target and case.target.strip()
        assert len(case.hole) + len(case.suffix) <= 64
        assert not case.before.endswith("\n")
        whole = case.before + "".join(map(chr, case.hole + case.suffix))
        assert whole in SOURCE  # before + hole + suffix is the source text, cut at the canvas' end


@given(functions=st.integers(0, 8), limit=st.integers(0, 12), seed=st.integers(0, 3))
def test_infill_cases_are_at_most_limit_and_the_same_first_ones(functions, limit, seed):
    """limit=0 gave one case (it was tested after a case was added), so `code_model.py --infills 0` ran an infill."""
    source = "".join(f"def f{k}(x):\n    y = x + {k}\n    return y\n\n" for k in range(functions))
    funcs = functions_in(source, "m.py")
    assert len(funcs) == functions
    every = infill_cases(funcs, CharTokenizer(), canvas=64, limit=functions, seed=seed)
    assert len(every) == functions  # each function here has a case: the limit is all that cuts them
    assert infill_cases(funcs, CharTokenizer(), canvas=64, limit=limit, seed=seed) == every[:limit]


@given(st.text(alphabet=" x=(1)", min_size=1, max_size=12).filter(lambda t: t.strip()), st.integers(0, 8),
       st.integers(0, 8), st.text(alphabet=" ", max_size=3))
def test_an_infill_matches_its_line_with_the_lines_indentation(line, indent, other, trailing):
    """The judge stripped both sides: a fill indented as another block (another program) counted as exact."""
    target = " " * indent + line.strip()
    assert fills_the_line("\n" + target + trailing, target)  # (the hole starts with the line's newline)
    assert fills_the_line(target, target)  # (AR's first line, its newline taken off)
    assert fills_the_line("\n" + " " * other + line.strip(), target) == (other == indent)
    assert not fills_the_line("\n\n" + target, target)  # a blank line first is another text


def test_infill_cases_refuses_a_negative_limit():
    import pytest

    funcs = functions_in(SOURCE, "m.py")
    assert infill_cases(funcs, CharTokenizer(), canvas=64, limit=0, seed=0) == []
    with pytest.raises(ValueError, match="limit: expected a non-negative integer, got -1"):
        infill_cases(funcs, CharTokenizer(), canvas=64, limit=-1, seed=0)


def test_space_infill_cases_cut_a_line_after_a_space_between_words():
    funcs = functions_in(SOURCE, "m.py")
    cases = space_infill_cases(funcs, CharTokenizer(), canvas=64, limit=10, seed=0)
    assert cases
    for case in cases:
        assert case.start.endswith(" ") and not case.start[-2].isspace() and case.target[:1].strip()
        assert "\n" not in case.start + case.target and case.length == len(" " + case.target)
        assert not case.before.endswith("\n") and case.length + len(case.suffix) <= 64
        assert case.before + "\n" + case.start + case.target + case.suffix in SOURCE  # the source, cut at the canvas


def test_space_infill_takes_a_later_body_line_where_the_first_has_no_cut():
    """Any body line but the last may be the hole: a function whose first line has no space between words gives its
    case from a later line (taking only the first line left such functions out)."""
    funcs = functions_in("def f(a):\n    a.x()\n    y = a + 1\n    return y\n", "m.py")
    cases = space_infill_cases(funcs, CharTokenizer(), canvas=64, limit=5, seed=0)
    assert len(cases) == 1 and (cases[0].start + cases[0].target).startswith("    y = a"), cases


@given(functions=st.integers(0, 8), limit=st.integers(0, 12), seed=st.integers(0, 3))
def test_space_infill_cases_are_at_most_limit_and_the_same_first_ones(functions, limit, seed):
    source = "".join(f"def f{k}(x):\n    y = x + {k}\n    return y\n\n" for k in range(functions))
    funcs = functions_in(source, "m.py")
    every = space_infill_cases(funcs, CharTokenizer(), canvas=64, limit=functions, seed=seed)
    assert len(every) == functions  # each function here has a case: the limit is all that cuts them
    assert all(c.start + c.target in (f"    y = x + {k}", "    return y") for k, c in enumerate(every))
    assert space_infill_cases(funcs, CharTokenizer(), canvas=64, limit=limit, seed=seed) == every[:limit]


def test_model_heldout_functions_reads_the_manifest(tmp_path):
    import json

    import pytest

    from blockpress.tasks.code import model_heldout_functions

    with pytest.raises(FileNotFoundError, match="corpus_manifest.json"):
        model_heldout_functions(tmp_path)
    (tmp_path / "corpus_manifest.json").write_text(json.dumps({"heldout_modules": ["copyreg.py"]}))
    funcs = model_heldout_functions(tmp_path)
    assert funcs and {f.module for f in funcs} == {"copyreg.py"}


def test_a_comment_at_column_0_in_the_header_does_not_stop_the_body_parsing():
    """A comment at column 0 between the def line and the body stays in the header, and stopped dedent: no body,
    the function's own included, could parse (14 of the stdlib's 17,009 functions)."""
    source = "class A:\n    def f(self):\n# a note at the margin\n        x = 1\n        return x\n"
    (function,) = functions_in(source, "m.py")
    assert "# a note" in function.header
    assert completion_parses(function, "\n" + function.body)
    assert not completion_parses(function, "\n        return (1\n")


def test_the_budget_ceiling_is_the_share_of_own_bodies_that_fit():
    """A body the token budget cuts inside a statement or an open bracket does not parse, so even the original
    code scores under 1 with a small budget: budget_ceiling reports that bound beside the engines' figures."""
    from pathlib import Path

    import blockpress
    from blockpress.tasks.code import budget_ceiling
    from blockpress.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(Path(blockpress.__file__).parent / "models" / "blockpress-code")
    short = functions_in("def f(x):\n    y = x + 1\n    return y\n", "m.py")
    cut = functions_in("def g(x):\n    return h(x, 1, 2, 3, 4, 5, 6, 7, 8, 9,\n             10, 11)\n", "m.py")
    functions = short + cut
    full = len(tok.encode("\n" + cut[0].body))
    assert budget_ceiling(tok, functions, full) == 1.0
    assert budget_ceiling(tok, functions, full - 4) == 0.5  # the open bracket's line is cut
    assert budget_ceiling(tok, [], 8) == 0.0


# From a mutation hunt over tasks/code.py: rules no test pinned.

def test_a_body_of_comments_alone_is_not_a_statement():
    """The module docstring: the body "must hold at least one statement that is not a comment". With a header
    that holds a statement of its own, dropping the comments leaves a program that parses, so only the rule
    itself can refuse it."""
    from blockpress.tasks.code import parses

    assert not parses("def f(): pass\n", "    # only a comment\n")
    assert not parses("def f(): pass\n", "    # one\n\n        # two\n")
    assert parses("def f():\n", "    # a comment\n    x = 1\n")  # beside a statement it is fine
    assert parses("def f():\n", '    """A docstring is a statement."""\n')


def test_functions_in_leaves_out_a_body_that_starts_on_the_def_line():
    """"Functions whose body starts on its own line": a body on the def line, even one spanning 2-15 lines,
    cannot be cut after a prompt that ends with the def line."""
    from blockpress.tasks.code import functions_in

    assert functions_in("def f(): return (1,\n    2)\n", "m.py") == []
    assert functions_in("def f(x): y = x; return (y,\n    2,\n    3)\n", "m.py") == []
    (kept,) = functions_in("def f():\n    return (1,\n    2)\n", "m.py")
    assert kept.header == "def f():\n" and kept.body == "    return (1,\n    2)\n"


def test_functions_in_keeps_bodies_of_2_to_15_lines():
    """The bounds are the body's line count, blank lines inside it included: 2 and 15 are in, 1 and 16 out."""
    from blockpress.tasks.code import functions_in

    for length in range(1, 21):
        for blanks in range(4):
            statements = [f"    x{k} = {k}\n" for k in range(length)]
            for k in range(min(blanks, length - 1)):  # a blank line inside the body counts as a line
                statements[k + 1] = "\n" + statements[k + 1]
            body = "".join(statements)
            lines = body.count("\n")
            found = functions_in("def f():\n" + body + "\n\ndef g():\n    pass\n", "m.py")
            assert [f.body for f in found] == ([body] if 2 <= lines <= 15 else []), (length, blanks)


def test_the_prompt_keeps_exactly_20_lines_of_context():
    from blockpress.tasks.code import CONTEXT_LINES, functions_in

    assert CONTEXT_LINES == 20
    for before in (0, 1, 19, 20, 21, 35):
        context = "".join(f"x{k} = {k}\n" for k in range(before))
        (f,) = functions_in(context + "def f():\n    a = 1\n    return a\n", "m.py")
        kept = f.prefix.splitlines(keepends=True)
        assert kept[-1] == "def f():\n" and len(kept) == min(before, 20) + 1, (before, len(kept))
        assert context.endswith("".join(kept[:-1]))  # the lines just before the def, none skipped


def test_repeats_a_line_counts_lines_of_exactly_the_shortest_length():
    from blockpress.tasks.code import repeats_a_line

    eight, seven = "x = f(1)", "x = f()"
    assert len(eight) == 8 and len(seven) == 7
    assert repeats_a_line(f"    {eight}\n" * 3)  # the default `shortest` is 8: a line of 8 counts
    assert not repeats_a_line(f"    {seven}\n" * 3)
    assert repeats_a_line(f"{seven}\n" * 3, shortest=7) and not repeats_a_line(f"{eight}\n" * 3, shortest=9)
    assert not repeats_a_line(f"{eight}\n" * 2) and repeats_a_line(f"{eight}\n" * 2, times=2)


def test_infill_cases_need_room_for_4_suffix_tokens():
    """A case is made only if the canvas holds the hole and at least 4 more tokens: room 4 is in, 3 is out."""
    from blockpress.tasks.code import functions_in, infill_cases, space_infill_cases

    funcs = functions_in("def f(x):\n    y = 1\n    z = 2\n", "m.py")  # both candidate lines: holes of 10 chars
    for seed in range(4):
        assert [len(c.hole) for c in infill_cases(funcs, CharTokenizer(), canvas=14, limit=1, seed=seed)] == [10]
        assert infill_cases(funcs, CharTokenizer(), canvas=13, limit=1, seed=seed) == []
    # the space infill likewise: "y =1" and "z =2" have one cut each, whose hole " =1" / " =2" is 3 characters
    funcs = functions_in("def f(x):\n    y =1\n    z =2\n", "m.py")
    for seed in range(4):
        assert [c.length for c in space_infill_cases(funcs, CharTokenizer(), canvas=7, limit=1, seed=seed)] == [3]
        assert space_infill_cases(funcs, CharTokenizer(), canvas=6, limit=1, seed=seed) == []


def test_a_comment_line_is_never_an_infill_target():
    """Only code lines become holes: a comment (at any indentation) is left in the context or the suffix."""
    from blockpress.tasks.code import functions_in, infill_cases, space_infill_cases

    source = "def f(x):\n    y = x + 1\n    # add one more\n    if y:\n        # note this\n        y = 2\n    return y\n"
    funcs = functions_in(source, "m.py")
    targets = {c.target for seed in range(40) for c in infill_cases(funcs, CharTokenizer(), 64, 1, seed)}
    assert targets == {"    y = x + 1", "    if y:", "        y = 2", "    return y"}  # each code line is drawn
    starts = {c.start for seed in range(40) for c in space_infill_cases(funcs, CharTokenizer(), 64, 1, seed)}
    assert starts and not any(s.lstrip().startswith("#") for s in starts)


def test_space_infill_cuts_only_at_a_single_space_between_words():
    """"A space following a word, followed by a word": a run of spaces (alignment) is never a cut, since the
    fixed text would end in a space after a space."""
    from blockpress.tasks.code import functions_in, space_infill_cases

    funcs = functions_in("def f(x):\n    y  =  x\n    return  y\n", "m.py")  # only double spaces: no cut
    assert all(space_infill_cases(funcs, CharTokenizer(), 64, 1, seed) == [] for seed in range(10))
    funcs = functions_in("def f(x):\n    y  = x\n    return  y\n", "m.py")  # one single space: "=" " " "x"
    cases = {c.start for seed in range(10) for c in space_infill_cases(funcs, CharTokenizer(), 64, 1, seed)}
    assert cases == {"    y  = "}


@given(st.lists(st.tuples(st.sampled_from(["a", "bc", "=", "(x)", "1"]), st.integers(1, 3)), min_size=1, max_size=6))
def test_space_infill_start_ends_in_one_space_after_a_word(words):
    from blockpress.tasks.code import functions_in, space_infill_cases

    line = '    s = "' + "".join(w + " " * gap for w, gap in words).rstrip() + '"'  # spaces inside a string count
    funcs = functions_in(f"def f(x):\n{line}\n    return x\n", "m.py")
    assert funcs
    for seed in range(5):
        for c in space_infill_cases(funcs, CharTokenizer(), 64, 1, seed):
            assert c.start.endswith(" ") and not c.start[-2].isspace() and c.target[:1].strip()
            assert c.start + c.target in (line, "    return x")


def test_the_bodys_own_comment_lines_are_parsed_as_python_parses_them():
    """The judge dropped every line starting with '#' before parsing, the body's too: one after a backslash, or one
    inside a triple-quoted string that closes it, changed the parse (code Python refuses accepted, and valid code
    refused). Only the header's comment lines go (one at column 0 stops dedent)."""
    import ast

    from blockpress.tasks.code import parses

    for body in ("    x = 1 + \\\n# note\n        2\n    return x\n", '    s = """\n# """ )\n    """\n    return s\n',
                 '    s = """\n    #"""\n    return s\n', "    # a comment\n    return 1\n"):
        try:
            ast.parse("def f():\n" + body)
            python = True
        except SyntaxError:
            python = False
        assert parses("def f():\n", body) is python, body


def test_a_manifest_split_from_another_pythons_stdlib_is_said(tmp_path):
    """The held-out modules are read from the running interpreter's stdlib: on another Python they hold other code
    (the published figures' functions are 3.11's), and nothing said so."""
    import json
    import sys
    import warnings

    from blockpress.tasks.code import model_heldout_functions

    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    for source, warned in ((f"/usr/lib/python{running}", False), ("/opt/py/lib/python3.1", True)):
        (tmp_path / "corpus_manifest.json").write_text(json.dumps({"source": source, "heldout_modules": ["json/decoder.py"]}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            functions = model_heldout_functions(tmp_path)
        said = [str(w.message) for w in caught if "standard library" in str(w.message)]
        assert functions and bool(said) == warned, said
        if warned:
            assert f"split from Python 3.1's standard library, and this is Python {running}" in said[0]



def test_functions_in_splits_lines_where_ast_counts_them():
    """ast's line numbers count only \\n, \\r\\n and \\r: a form feed (an Emacs ^L page break) on a line of its
    own, or \\v, \\x1c, \\x85, U+2028 in a comment, must not shift the prefix, header or body after it."""
    from blockpress.tasks.code import functions_in

    for odd in ("\x0c", "\x0b", "\x1c", "\x85", "\u2028"):
        page = "\x0c\n" if odd == "\x0c" else ""  # only a form feed may stand on a line alone
        source = f"import os  # a{odd}b\n{page}\ndef area(r):\n    pi = 3.14  # {odd}\n    return pi * r * r\n"
        (f,) = functions_in(source, "m.py")
        assert f.header == "def area(r):\n", repr(odd)
        assert f.body == f"    pi = 3.14  # {odd}\n    return pi * r * r\n", repr(odd)
        assert f.prefix == f"import os  # a{odd}b\n{page}\ndef area(r):\n", repr(odd)
    # a lone CR and CRLF are line ends to ast, and stay so
    (f,) = functions_in("x = 1\r\rdef f():\r\n    a = 1\r    return a\r", "m.py")
    assert (f.header, f.body) == ("def f():\r\n", "    a = 1\r    return a\r")
