"""The paper's generation protocol (App. A.2, Table 7): shots, prompt formats, chat templates, system
prompts, stop sequences and max new tokens per model family and benchmark, and the prompts they build.

    Ouro    plain text, no chat template: GSM8K 3-shot CoT; MATH500 0-shot, boxed answer; HumanEval and
            MBPP 0-shot, EvalPlus-style
    Huginn  its chat template: GSM8K 8-shot CoT with the system prompt "You are a helpful assistant that
            can assist users with mathematical reasoning."; MATH500 4-shot adapted Minerva, no system
            prompt, asked for \\boxed{} and Minerva's "Final Answer:" line; code as Ouro's

Max new tokens: GSM8K and HumanEval 1024, MATH500 and MBPP 2048. GSM8K's shots are the chain-of-thought
exemplars of Wei et al. (the first k of lm-evaluation-harness's `gsm8k_cot`), written "Q: ...\\nA: ..."
and ending "The answer is N."; MATH500's are Minerva's four (Lewkowycz et al.), each ending with its
boxed answer and "Final Answer: The final answer is X. I hope it is correct.". Through a chat template
the shots are earlier turns (user "Q: ...\\nA:", assistant the worked answer), as lm-evaluation-harness
renders few-shot examples as a multi-turn chat. Code prompts are EvalPlus's instruction prompt: ask for
a self-contained Python script in a code block and prefill the answer up to an open ```python fence
(through a chat template: the assistant turn rendered and cut at that point, as EvalPlus cuts it).

`raw` is the other format: the benchmark's own text as it is (`Problem.prompt`), no shots, no template,
for models that know only their own task format (the shipped small models).
"""

from __future__ import annotations

import dataclasses
from rq_jax.eval.benchmarks import CodeProblem, MathProblem
from rq_jax.serve.chat import ChatTemplate, ChatTemplateError

BENCHMARKS = ("gsm8k", "math500", "humaneval", "mbpp")
FORMATS = ("paper", "raw")

GSM8K_SYSTEM = "You are a helpful assistant that can assist users with mathematical reasoning."
#: (question, worked answer) of the GSM8K chain-of-thought exemplars, in their usual order.
GSM8K_SHOTS = (
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
     "there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
     "been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, "
     "they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did "
     "Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. "
     "The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have "
     "now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. "
     "The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to "
     "thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
     "computers were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf "
     "balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, "
     "he had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
     "left. 23 - 15 is 8. The answer is 8."),
)
#: (problem, solution) of Minerva's four MATH exemplars.
MINERVA_SHOTS = (
    (r"Find the domain of the expression  $\frac{\sqrt{x-2}}{\sqrt{5-x}}$.}",
     r"The expressions inside each square root must be non-negative. Therefore, $x-2 \ge 0$, so $x\ge2$, and "
     r"$5 - x \ge 0$, so $x \le 5$. Also, the denominator cannot be equal to zero, so $5-x>0$, which gives $x<5$. "
     r"Therefore, the domain of the expression is $\boxed{[2,5)}$." "\n"
     r"Final Answer: The final answer is $[2,5)$. I hope it is correct."),
    (r"If $\det \mathbf{A} = 2$ and $\det \mathbf{B} = 12,$ then find $\det (\mathbf{A} \mathbf{B}).$",
     r"We have that $\det (\mathbf{A} \mathbf{B}) = (\det \mathbf{A})(\det \mathbf{B}) = (2)(12) = \boxed{24}.$"
     "\n" r"Final Answer: The final answer is $24$. I hope it is correct."),
    ("Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, how many "
     "times must Terrell lift them in order to lift the same total weight?",
     r"If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\cdot 12\cdot20=480$ pounds of "
     r"weight.  If he lifts two 15-pound weights instead for $n$ times, he will lift a total of "
     r"$2\cdot15\cdot n=30n$ pounds of weight.  Equating this to 480 pounds, we can solve for $n$:" "\n"
     r"\begin{align*}" "\n" r"30n&=480\\" "\n" r"\Rightarrow\qquad n&=480/30=\boxed{16}" "\n" r"\end{align*}"
     "\n" r"Final Answer: The final answer is $16$. I hope it is correct."),
    ("If the system of equations\n\n" r"\begin{align*}" "\n" r"6x-4y&=a,\\" "\n" r"6y-9x &=b." "\n"
     r"\end{align*}has a solution $(x, y)$ where $x$ and $y$ are both nonzero," "\n"
     r"find $\frac{a}{b},$ assuming $b$ is nonzero.",
     r"If we multiply the first equation by $-\frac{3}{2}$, we obtain" "\n\n" r"$$6y-9x=-\frac{3}{2}a.$$"
     r"Since we also know that $6y-9x=b$, we have" "\n\n"
     r"$$-\frac{3}{2}a=b\Rightarrow\frac{a}{b}=\boxed{-\frac{2}{3}}.$$" "\n"
     r"Final Answer: The final answer is $-\frac{2}{3}$. I hope it is correct."),
)
MATH_INSTRUCTION = "Solve the problem step by step and put your final answer within \\boxed{}."
MINERVA_INSTRUCTION = ('Then end with the line "Final Answer: The final answer is $X$. I hope it is correct." '
                       "where X is the final answer.")
#: EvalPlus's instruction and response prefix (`evalplus.codegen`, instruct models).
CODE_INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a "
                    "markdown code block:")
CODE_RESPONSE = ("Below is a Python script with a self-contained function that solves the problem and passes "
                 "corresponding tests:")
_SPLIT = "\x00rq-jax-prefill\x00"  # where a rendered assistant turn is cut (EvalPlus's "magic splitter")

#: Stop strings: lm-evaluation-harness's `gsm8k_cot` (a next question); Minerva's next problem; the end
#: of the code block and EvalPlus's end-of-program markers.
STOPS = {"gsm8k": ("Q:", "</s>", "<|im_end|>"), "math500": ("Problem:", "</s>", "<|im_end|>"),
         "humaneval": ("\n```", "\nif __name__", "\ndef main(", "\nprint("),
         "mbpp": ("\n```", "\nif __name__", "\ndef main(", "\nprint(")}
#: `raw` format stops: the shipped models end an answer with a newline; code as EvalPlus's direct
#: completion (its end-of-program markers, and for HumanEval a next top-level statement).
RAW_STOPS = {"gsm8k": ("\n",), "math500": ("\n",),
             "humaneval": ("\ndef ", "\nclass ", "\nimport ", "\nfrom ", "\nassert ", "\nif __name__", "\nprint("),
             "mbpp": ('\n"""', "\nassert", "\nif __name__", "\nprint(")}
MAX_NEW_TOKENS = {"gsm8k": 1024, "math500": 2048, "humaneval": 1024, "mbpp": 2048}


@dataclasses.dataclass(frozen=True)
class Protocol:
    """How one model family runs one benchmark: `shots` worked examples, through the checkpoint's chat
    template when `chat` (with `system` as the system prompt, or none), ended by `stop` strings (and the
    tokenizer's end-of-turn tokens) or `max_new_tokens`. `format` is "paper" or "raw"."""

    benchmark: str
    format: str
    shots: int
    chat: bool
    system: str | None
    stop: tuple[str, ...]
    max_new_tokens: int

    @property
    def scripts(self) -> bool:
        """Whether a code completion is a whole script (the paper's prompts) rather than a continuation."""
        return self.format == "paper" and self.benchmark in ("humaneval", "mbpp")


def protocol(family: str, benchmark: str, fmt: str = "paper", *, shots: int | None = None,
             max_new_tokens: int | None = None) -> Protocol:
    """The protocol of a family ("ouro" or "huginn") on a benchmark, in the paper's format or `raw`, with
    `shots` worked examples and `max_new_tokens` when given (default: the paper's). Raises ValueError
    naming a bad argument."""
    p = _protocol(family, benchmark, fmt)
    return dataclasses.replace(p, shots=p.shots if shots is None else shots,
                               max_new_tokens=max_new_tokens or p.max_new_tokens)


def _protocol(family: str, benchmark: str, fmt: str) -> Protocol:
    for name, value, known in (("family", family, ("ouro", "huginn")), ("benchmark", benchmark, BENCHMARKS),
                               ("prompt format", fmt, FORMATS)):
        if value not in known:
            raise ValueError(f"unknown {name} {value!r}: expected one of {', '.join(known)}")
    if fmt == "raw":
        return Protocol(benchmark, fmt, 0, False, None, RAW_STOPS[benchmark], MAX_NEW_TOKENS[benchmark])
    huginn = family == "huginn"
    shots = {"gsm8k": 8 if huginn else 3, "math500": 4 if huginn else 0}.get(benchmark, 0)
    system = GSM8K_SYSTEM if huginn and benchmark == "gsm8k" else None
    return Protocol(benchmark, fmt, shots, huginn, system, STOPS[benchmark], MAX_NEW_TOKENS[benchmark])


def _turns(p: Protocol, problem: MathProblem | CodeProblem) -> tuple[list[tuple[str, str]], str]:
    """(shots as (user, assistant) pairs, the problem's user text) in the paper's format."""
    if p.benchmark == "gsm8k":
        return [(f"Q: {q}\nA:", a) for q, a in GSM8K_SHOTS[: p.shots]], f"Q: {problem.question}\nA:"
    if p.benchmark == "math500":
        ask = MATH_INSTRUCTION + (" " + MINERVA_INSTRUCTION if p.chat else "")

        def user(text: str) -> str:
            return f"Problem:\n{text}\n\n{ask}"

        return [(user(q), f"Solution:\n{a}") for q, a in MINERVA_SHOTS[: p.shots]], user(problem.question)
    return [], f"{CODE_INSTRUCTION}\n```\n{problem.prompt.strip()}\n```\n"


def _prefill(p: Protocol) -> str:
    """What the answer starts with: an open Python code fence for code, nothing otherwise."""
    return f"{CODE_RESPONSE}\n```python\n" if p.benchmark in ("humaneval", "mbpp") else ""


def build_prompt(p: Protocol, problem: MathProblem | CodeProblem, template: ChatTemplate | None = None) -> str:
    """The prompt text of `problem` under protocol `p`: raw, plain text (shots joined by blank lines, then
    the question and what opens its answer: MATH's "Solution:", code's prefill), or rendered by `template`
    (required when `p.chat`; raises ValueError without one, `ChatTemplateError` when the template refuses
    the messages)."""
    if p.format == "raw":
        return problem.prompt
    shots, question = _turns(p, problem)
    prefill = _prefill(p)
    if not p.chat:  # a worked answer follows its question after a space (GSM8K's "A:") or a blank line
        sep = " " if p.benchmark == "gsm8k" else "\n\n"
        cue = "\n\nSolution:" if p.benchmark == "math500" else (f"\n{prefill}" if prefill else "")
        return "".join(f"{u}{sep}{a}\n\n" for u, a in shots) + question + cue
    if template is None:
        raise ValueError(f"the paper's {p.benchmark} prompt for this model goes through its chat template, but the "
                         "checkpoint's tokenizer_config.json has none (use --prompt-format raw)")
    messages = [{"role": "system", "content": p.system}] if p.system else []
    for u, a in shots:
        messages += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": question})
    if not prefill:
        return template.render(messages, add_generation_prompt=True)
    messages.append({"role": "assistant", "content": prefill + _SPLIT + "\n```\n"})
    rendered = template.render(messages, add_generation_prompt=False)
    if _SPLIT not in rendered:
        raise ValueError("the chat template drops the assistant turn's text: cannot prefill the code fence")
    return rendered.split(_SPLIT)[0]


def describe(p: Protocol) -> str:
    """The protocol in a few words, for table headers."""
    if p.format == "raw":
        return "raw prompts (the benchmark's text as it is)"
    how = f"{p.shots}-shot" + (", chat template" if p.chat else ", plain text")
    return how + (f", system prompt \"{p.system}\"" if p.system else "")


def encode_prompts(p: Protocol, problems, template: ChatTemplate | None, tokenizer,
                   max_positions: int) -> tuple[dict[str, list[int]], int, int]:
    """Every problem's prompt (`build_prompt`) as token ids: (problem id -> ids in the problems' order,
    the longest prompt's tokens, the positions a slot needs: that plus `p.max_new_tokens` - 1). A rendered
    chat template spells its own special tokens (as HF's apply_chat_template + tokenize). ValueError
    opening with the option to blame ("argument --prompt-format: ...") for a prompt that cannot be built,
    one that tokenizes to nothing, or prompts longer than `max_positions` allows."""
    try:
        texts = {q.id: build_prompt(p, q, template) for q in problems}
    except (ValueError, ChatTemplateError) as err:
        raise ValueError(f"argument --prompt-format: {err}") from None
    ids = {i: tokenizer.encode(t, add_special_tokens=not p.chat).ids for i, t in texts.items()}
    if min(len(x) for x in ids.values()) == 0:
        raise ValueError("argument --data: a prompt tokenizes to nothing")
    longest = max(len(x) for x in ids.values())
    max_len = longest + p.max_new_tokens - 1
    if max_len > max_positions and p.format != "raw":
        raise ValueError(f"argument --prompt-format: the {p.format} prompts ({p.shots} shots) are up to {longest} "
                         f"tokens; with {p.max_new_tokens} new tokens they need {max_len} positions, more than the "
                         f"model's {max_positions}: use --prompt-format raw (the benchmark's own text, no shots) for "
                         "a small model")
    if max_len > max_positions:
        raise ValueError(f"argument --max-new-tokens: the longest prompt ({longest} tokens) plus {p.max_new_tokens} "
                         f"new tokens needs {max_len} positions, more than the model's {max_positions}")
    return ids, longest, max_len
