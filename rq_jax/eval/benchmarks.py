"""Real benchmarks: readers for GSM8K, MATH500, HumanEval and MBPP JSONL files, and their scorers.

Readers turn a local file (JSONL, optionally gzipped) into typed problems; a problem's `prompt` is the
benchmark's own text as it is (GSM8K's question, MATH's problem, HumanEval's signature and docstring,
MBPP's task and first test as EvalPlus writes it). The paper's prompt formats (shots, chat templates,
instructions) are built from these in `rq_jax.eval.prompts`. Scorers take one completion per problem
and return one `Result` per problem; `pass_at_1` averages them. GSM8K compares the final number
exactly; MATH500 compares the last `\\boxed{}` answer (else Minerva's "Final Answer: The final answer
is ...") with `math_verify`; HumanEval and MBPP run program + tests in a sandboxed subprocess
(`run_program`), a completion either continuing the prompt or, cleaned by `clean_code` as EvalPlus
cleans one, a whole script.

The sandbox is best effort, not a security boundary: a fresh temporary working directory, an
isolated interpreter (`python -I`, stdin/stdout closed, no proxy variables), limits on address space,
CPU time, file size and core files, a wall-clock timeout that kills the whole process group, and no
network: the run is wrapped in `unshare --net` (or `unshare --user --map-root-user --net` when
unprivileged) where that works, and in every case the program starts with `socket.socket` replaced
by a class that raises PermissionError. The limits are set with `resource.setrlimit` by the sandboxed
interpreter itself before it reads the program, not in a `preexec_fn`: that is not safe in a process
with threads (JAX's runtime, the worker pool of `score_code`).
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import decimal
import functools
import gzip
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class MathProblem:
    """A GSM8K or MATH500 problem: `prompt` is the question as it is; `answer` is the reference final
    answer (GSM8K: the number after `####`, canonical as `gsm8k_answer` writes it; MATH500: the `answer`
    field, LaTeX)."""

    id: str
    prompt: str
    question: str
    answer: str
    solution: str


@dataclasses.dataclass(frozen=True)
class CodeProblem:
    """A HumanEval or MBPP problem. The program run for a completion that continues the prompt is
    `setup + prefix + completion + "\\n" + test` (see `program`); `reference` is the dataset's own
    solution in completion form, so `program(reference)` must pass. A completion that is a whole
    script (the paper's prompts ask for one) runs as `script_program` builds it. `entry_point` names
    the function the tests call."""

    id: str
    prompt: str  # HumanEval: signature and docstring; MBPP: '"""\\n<task>\\n<first test>\\n"""\\n'
    prefix: str  # HumanEval: the prompt (completions continue it); MBPP: ""
    reference: str
    test: str
    setup: str = ""
    entry_point: str = ""

    def program(self, completion: str) -> str:
        """The full Python program that checks `completion` (a continuation of `prefix`)."""
        return f"{self.setup}{self.prefix}{completion}\n{self.test}\n"

    def script_program(self, script: str) -> str:
        """The program that checks a whole script: `prefix` (its imports and helper functions stay in scope:
        HumanEval's own tests call some of them, e.g. HumanEval/50's `encode_shift`), then the script as
        `clean_code` reads it (its definitions replace the prefix's), then the tests."""
        return self.program("\n" + clean_code(script, self.entry_point))


@dataclasses.dataclass(frozen=True)
class Result:
    """One problem's score: reason is "passed", "failed: <why>" or "timed out"."""

    id: str
    passed: bool
    reason: str


# --------------------------------------------------------------------------------------------- prompts


def mbpp_task_prompt(text: str, tests: Sequence[str]) -> str:
    """An MBPP task as EvalPlus's MBPP+ prompt writes it: a docstring of the task and its first test."""
    return f'"""\n{text.strip()}\n{tests[0].strip()}\n"""\n' if tests else f'"""\n{text.strip()}\n"""\n'


# --------------------------------------------------------------------------------------------- readers


def _rows(path: str | os.PathLike, fields: dict[str, type | tuple[type, ...]]):
    """(row index, line number, row) of a JSONL file (gzipped when it ends in .gz), blank lines
    skipped; every row must be a JSON object with `fields` of the given types."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        index = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for name, kind in fields.items():
                if name not in row:
                    raise ValueError(f"{path}:{lineno}: missing field {name!r}")
                if not isinstance(row[name], kind):
                    expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
                    raise ValueError(f"{path}:{lineno}: field {name!r} is {type(row[name]).__name__}, "
                                     f"expected {expected}")
            yield index, lineno, row
            index += 1


def _string_list(path, lineno: int, row: dict, name: str) -> list[str]:
    """Field `name` of a row as a list of strings ([] when absent or null)."""
    value = row.get(name) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{path}:{lineno}: field {name!r} must be a list of strings")
    return value


def read_gsm8k(path: str | os.PathLike) -> list[MathProblem]:
    """GSM8K JSONL (`question`, `answer` = solution ending in `#### <number>`); ids are row indices."""
    problems = []
    for index, lineno, row in _rows(path, {"question": str, "answer": str}):
        _, marker, final = row["answer"].rpartition("####")
        number = _first_number(final) if marker else None
        if number is None:
            raise ValueError(f"{path}:{lineno}: field 'answer' does not end in '#### <number>'")
        problems.append(MathProblem(str(index), row["question"], row["question"], number, row["answer"]))
    return problems


def read_math500(path: str | os.PathLike) -> list[MathProblem]:
    """MATH500 JSONL (`problem`, `solution`, `answer`); ids are `unique_id` when present, else row
    indices."""
    return [MathProblem(str(row.get("unique_id", index)), row["problem"], row["problem"], row["answer"],
                        row["solution"])
            for index, _, row in _rows(path, {"problem": str, "solution": str, "answer": str})]


def read_humaneval(path: str | os.PathLike) -> list[CodeProblem]:
    """HumanEval JSONL or .jsonl.gz (`task_id`, `prompt`, `canonical_solution`, `test`,
    `entry_point`); a completion continues the prompt and the test calls `check(entry_point)`."""
    fields = {"task_id": str, "prompt": str, "canonical_solution": str, "test": str, "entry_point": str}
    return [CodeProblem(row["task_id"], row["prompt"], row["prompt"], row["canonical_solution"],
                        f"{row['test']}\ncheck({row['entry_point']})", entry_point=row["entry_point"])
            for _, _, row in _rows(path, fields)]


def read_mbpp(path: str | os.PathLike, challenge_tests: bool = False) -> list[CodeProblem]:
    """MBPP JSONL (`task_id`, `text`, `code`, `test_list`, optional `test_setup_code`,
    `challenge_test_list` and `entry_point`), or MBPP+'s (EvalPlus's 378 tasks: `prompt` for `text`,
    `test_imports` for `test_setup_code`); a completion is a whole program, checked by the asserts of
    `test_list` (and `challenge_test_list` when `challenge_tests`). The prompt shows the first test
    (`mbpp_task_prompt`). Without `entry_point`, it is the first function of `code` that the first
    test calls."""
    problems = []
    for _, lineno, row in _rows(path, {"task_id": (int, str), "code": str, "test_list": list}):
        text = row.get("text", row.get("prompt"))
        if not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: missing field 'text' (MBPP) or 'prompt' (MBPP+), or not a string")
        tests = _string_list(path, lineno, row, "test_list")
        checks = tests + (_string_list(path, lineno, row, "challenge_test_list") if challenge_tests else [])
        setup = row.get("test_setup_code") or "\n".join(_string_list(path, lineno, row, "test_imports"))
        if not isinstance(setup, str):
            raise ValueError(f"{path}:{lineno}: field 'test_setup_code' must be a string")
        entry = row.get("entry_point") or _called_function(row["code"], tests[:1])
        if not isinstance(entry, str):
            raise ValueError(f"{path}:{lineno}: field 'entry_point' must be a string")
        problems.append(CodeProblem(str(row["task_id"]), mbpp_task_prompt(text, tests), "", row["code"],
                                    "\n".join(checks), setup + "\n" if setup else "", entry))
    return problems


def _called_function(code: str, tests: Sequence[str]) -> str:
    """The first function defined at the top level of `code` whose name is called in `tests` ("" if none)."""
    try:
        names = [n.name for n in ast.parse(code).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    except SyntaxError:
        return ""
    called = {n.func.id for t in tests for n in ast.walk(_parse_or_empty(t))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return next((name for name in names if name in called), "")


def _parse_or_empty(source: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


# --------------------------------------------------------------------------------------------- GSM8K

# A number: optional minus (not right after a word character, so "10-3" is 3), optional $, an integer
# with thousands commas ("1,234") or plain digits, optional decimals (a trailing "." is not one).
_NUMBER = re.compile(r"(?:(?<![\w)])([-−]))?\$?(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")
_ANSWER_IS = re.compile(r"(?i)\banswer is\b")


def _canonical(match: re.Match) -> str:
    """A `_NUMBER` match as a canonical decimal string ("-1234", "3.5")."""
    sign, whole, frac = match.groups()
    value = decimal.Decimal(("-" if sign else "") + whole.replace(",", "") + (frac or "")).normalize()
    return format(value + 0, "f")  # + 0 turns -0 into 0


def _first_number(text: str) -> str | None:
    """The first number in `text`, canonical, or None."""
    match = _NUMBER.search(text)
    return _canonical(match) if match else None


def gsm8k_answer(completion: str) -> str | None:
    """The final number of a completion as a canonical decimal string ("1234", "-5", "3.5"), or None.

    Takes the first number after the last `####`, else after the last "answer is", else the last
    number in the text; commas in "1,234", `$` signs and trailing periods are ignored.
    """
    for marker in ("####", _ANSWER_IS):
        starts = [m.end() for m in re.finditer(marker, completion)]
        if starts and (number := _first_number(completion[starts[-1]:])) is not None:
            return number
    numbers = list(_NUMBER.finditer(completion))
    return _canonical(numbers[-1]) if numbers else None


def score_gsm8k(problems: Sequence[MathProblem], completions: Sequence[str]) -> list[Result]:
    """Exact numeric match of each completion's `gsm8k_answer` with the reference (3.50 == 3.5)."""
    return _score_answers(problems, completions, gsm8k_answer, lambda a, b: decimal.Decimal(a) == decimal.Decimal(b),
                          "no number in the completion")


def _score_answers(problems, completions, extract, equal, missing: str) -> list[Result]:
    """One Result per problem: `extract` the completion's answer (None: failed with `missing`), then
    `equal(answer, reference)`."""
    results = []
    for problem, completion in zip(_check_lengths(problems, completions), completions):
        got = extract(completion)
        if got is None:
            results.append(Result(problem.id, False, f"failed: {missing}"))
        elif equal(got, problem.answer):
            results.append(Result(problem.id, True, "passed"))
        else:
            results.append(Result(problem.id, False, f"failed: answered {got}, expected {problem.answer}"))
    return results


# --------------------------------------------------------------------------------------------- MATH500

_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")


def _braced(text: str, start: int) -> str | None:
    """The contents of the brace group opening at text[start] ("{"), or None if it never closes;
    escaped braces (\\{, \\}) do not count."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return text[start + 1:i]
        i += 1
    return None


def boxed_answer(completion: str) -> str | None:
    """The contents of the last complete `\\boxed{...}` or `\\fbox{...}` (nested braces allowed;
    also `\\boxed 5`), stripped, or None when there is none."""
    for match in reversed(list(_BOX.finditer(completion))):
        rest = completion[match.end():]
        body = rest.lstrip()
        if body.startswith("{"):
            content = _braced(body, 0)
        else:  # "\boxed 5": one token, up to whitespace or "$"
            content = re.match(r"[^\s$]*", body).group() if rest[:1].isspace() else None
        if content:
            return content.strip()
    return None


# Minerva's answer line, which its few-shot solutions end with:
# "Final Answer: The final answer is $X$. I hope it is correct."
_FINAL_ANSWER = re.compile(r"Final Answer: The final answer is(.*?)\. I hope it is correct\.")


def math_answer(completion: str) -> str | None:
    """A MATH completion's final answer: `boxed_answer`, else the last Minerva "Final Answer: The final
    answer is X. I hope it is correct." (X without its `$` signs; the sentence may stop after X), or None."""
    boxed = boxed_answer(completion)
    if boxed is not None:
        return boxed
    found = _FINAL_ANSWER.findall(completion + ". I hope it is correct.")
    answer = found[-1].strip().rstrip(".").strip("$ ") if found else ""
    return answer or None


def math_equal(answer: str, reference: str) -> bool:
    """Whether a LaTeX answer equals the LaTeX reference by `math_verify` (both parsed as a box).

    `math_verify` times out with signal.alarm, so call this from the main thread.
    """
    from math_verify import parse, verify  # optional: math-verify (the [eval] extra)

    return bool(verify(parse(f"\\boxed{{{reference}}}"), parse(f"\\boxed{{{answer}}}")))


def score_math500(problems: Sequence[MathProblem], completions: Sequence[str]) -> list[Result]:
    """Each completion's `math_answer` against the reference by `math_equal` (none: failed)."""
    return _score_answers(problems, completions, math_answer, math_equal, "no \\boxed{} or Final Answer")


# --------------------------------------------------------------------------------------------- code

def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):  # ValueError: null bytes
        return False
    return True


def _longest_parsable(lines: list[str]) -> list[str]:
    """The longest run of consecutive lines that parses as Python (by non-blank lines; the first such run)."""
    if _parses("\n".join(lines)):
        return lines
    best, best_len = [], 0
    filled = [0]  # filled[j]: non-blank lines among lines[:j]
    for line in lines:
        filled.append(filled[-1] + bool(line.strip()))
    for i in range(len(lines)):
        if lines[i][:1].isspace():  # an indented first line never parses
            continue
        for j in range(len(lines), i, -1):
            size = filled[j] - filled[i]
            if size <= best_len:
                break
            if _parses("\n".join(lines[i:j])):
                best, best_len = lines[i:j], size
                break
    return best


def clean_code(text: str, entry_point: str = "") -> str:
    """The program in a code completion, read the way EvalPlus's sanitizer reads one: the longest run of
    lines that parses (code fences and prose do not), and of that its imports and top-level
    functions, classes and assignments — with `entry_point`, only the definitions it reaches — in
    their order (imports first); tests, prints and `__main__` blocks are dropped. Returns the parsable
    run itself when that keeps nothing."""
    code = "\n".join(_longest_parsable(text.split("\n")))
    lines = code.split("\n")
    imports, defs, seen = [], {}, set()
    for node in ast.parse(code).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
                target := node.targets[0] if isinstance(node, ast.Assign) else node.target, ast.Name):
            name = target.id
        else:
            continue
        if name not in seen:  # the first definition of a name is kept, as EvalPlus keeps it
            seen.add(name)
            defs[name] = node
    keep = set(defs)
    if entry_point:
        keep, todo = {entry_point}, [entry_point]
        while todo:
            node = defs.get(todo.pop())
            for used in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} if node else ():
                if used in defs and used not in keep:
                    keep.add(used)
                    todo.append(used)

    def source(node) -> str:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return "\n".join(lines[first - 1 : node.end_lineno])

    kept = [source(n) for n in imports] + [source(n) for name, n in defs.items() if name in keep]
    return "\n".join(kept) if kept else code


# Runs in the sandboxed interpreter: argv = program, result file, address space (bytes), CPU seconds,
# max file size (bytes). Sets the limits, blocks sockets, runs the program as __main__ and writes
# "passed" or "failed: <exception>" to the result file.
_RUNNER = r"""
import builtins, os, resource, socket, _socket, sys
program, result, memory, cpu, fsize = sys.argv[1:]
for kind, soft, hard in ((resource.RLIMIT_AS, int(memory), int(memory)), (resource.RLIMIT_CPU, int(cpu), int(cpu) + 1),
                         (resource.RLIMIT_CORE, 0, 0), (resource.RLIMIT_FSIZE, int(fsize), int(fsize))):
    limit = resource.getrlimit(kind)[1]  # an unprivileged process cannot raise its hard limit
    if limit != resource.RLIM_INFINITY:
        soft, hard = min(soft, limit), min(hard, limit)
    resource.setrlimit(kind, (soft, hard))
class NoNetwork(socket.socket):
    def __init__(self, *args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")
socket.socket = _socket.socket = NoNetwork
out = os.open(result, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
with open(program, encoding="utf-8") as f:
    source = f.read()
try:
    exec(compile(source, program, "exec"), {"__name__": "__main__", "__file__": program, "__builtins__": builtins})
except BaseException as e:
    message = str(e).splitlines()[0][:300] if str(e).strip() else ""
    os.write(out, ("failed: " + type(e).__name__ + (": " + message if message else "")).encode())
    os._exit(1)
os.write(out, b"passed")
os._exit(0)
"""

_MAX_FILE_BYTES = 16 << 20


@functools.lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    """The command prefix that runs a program in a new network namespace, or () when unavailable."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "--net", "--"), (unshare, "--user", "--map-root-user", "--net", "--")):
        try:
            if subprocess.run([*prefix, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return ()


def run_program(source: str, timeout: float = 10.0, memory_mb: int = 2048) -> str:
    """Run a Python program in the sandbox (see the module docstring); returns "passed" (it ran to the
    end), "timed out" (wall clock `timeout` seconds or the CPU-time limit) or "failed: <why>".

    Limits: address space `memory_mb` MiB, CPU time ceil(timeout) + 1 s, files 16 MiB, no core files.
    """
    with tempfile.TemporaryDirectory(prefix="rq_jax_sandbox_") as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "work").mkdir()
        (tmp / "program.py").write_text(source, encoding="utf-8")
        cmd = [*_unshare_prefix(), sys.executable, "-I", "-c", _RUNNER, str(tmp / "program.py"),
               str(tmp / "result"), str(memory_mb << 20), str(math.ceil(timeout) + 1), str(_MAX_FILE_BYTES)]
        env = {"PATH": os.defpath, "HOME": str(tmp / "work"), "TMPDIR": str(tmp / "work"), "LANG": "C.UTF-8"}
        with open(tmp / "stderr", "wb") as stderr:
            proc = subprocess.Popen(cmd, cwd=tmp / "work", env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
            try:
                proc.wait(timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:  # the program's own children too
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        if timed_out or proc.returncode == -signal.SIGXCPU:
            return "timed out"
        if (tmp / "result").is_file() and (reason := (tmp / "result").read_text(errors="replace")):
            return reason
        if proc.returncode < 0:
            return f"failed: killed by {signal.Signals(-proc.returncode).name}"
        lines = (tmp / "stderr").read_text(errors="replace").strip().splitlines()
        return f"failed: exit status {proc.returncode}" + (f": {lines[-1][:300]}" if lines else "")


def score_code(problems: Sequence[CodeProblem], completions: Sequence[str], timeout: float = 10.0,
               memory_mb: int = 2048, workers: int | None = None, scripts: bool = False) -> list[Result]:
    """Run each problem's `program(completion)` — `script_program(completion)` when `scripts` (whole
    scripts, cleaned) — with `run_program`, `workers` at a time (default: the CPU count); passed when
    it runs to the end (every assert held)."""
    _check_lengths(problems, completions)

    def run(p: CodeProblem, c: str) -> str:
        return run_program(p.script_program(c) if scripts else p.program(c), timeout, memory_mb)

    with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        reasons = pool.map(run, problems, completions)
        return [Result(p.id, reason == "passed", reason) for p, reason in zip(problems, reasons)]


def pass_at_1(results: Sequence[Result]) -> float:
    """The fraction of problems passed (pass@1 with one completion per problem)."""
    if not results:
        raise ValueError("pass@1 of no results")
    return sum(r.passed for r in results) / len(results)


def _check_lengths(problems: Sequence[Any], completions: Sequence[str]) -> Sequence[Any]:
    """`problems`, after checking that there is one completion per problem."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    return problems
