"""The paper's protocol (Table 7, App. A.2) and the prompts it builds: plain text for Ouro, a chat template
with the system prompt for Huginn, code prompts prefilled up to an open fence, and `raw`."""

import dataclasses

import pytest

from rq_jax.eval import benchmarks as bm
from rq_jax.eval import prompts
from rq_jax.serve.chat import ChatTemplate

GSM = bm.MathProblem("0", "Tom has 2 apples and buys 3. How many?", "Tom has 2 apples and buys 3. How many?", "5", "")
MATH = bm.MathProblem("m", "What is $1+1$?", "What is $1+1$?", "2", "")
CODE = bm.CodeProblem("Test/0", 'def add(a, b):\n    """Sum."""\n', 'def add(a, b):\n    """Sum."""\n',
                      "    return a + b\n", "", entry_point="add")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHOT_Q = ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
          "there will be 21 trees. How many trees did the grove workers plant today?")
SHOT_A = ("There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
          "been 21 - 15 = 6. The answer is 6.")


@pytest.mark.parametrize("family, benchmark, shots, chat, system, max_new", [
    ("ouro", "gsm8k", 3, False, None, 1024), ("ouro", "math500", 0, False, None, 2048),
    ("ouro", "humaneval", 0, False, None, 1024), ("ouro", "mbpp", 0, False, None, 2048),
    ("huginn", "gsm8k", 8, True, prompts.GSM8K_SYSTEM, 1024), ("huginn", "math500", 4, True, None, 2048),
    ("huginn", "humaneval", 0, True, None, 1024), ("huginn", "mbpp", 0, True, None, 2048),
])
def test_protocol_is_table_7(family, benchmark, shots, chat, system, max_new):
    p = prompts.protocol(family, benchmark)
    assert (p.shots, p.chat, p.system, p.max_new_tokens) == (shots, chat, system, max_new)
    assert p.scripts == (benchmark in ("humaneval", "mbpp"))
    raw = prompts.protocol(family, benchmark, "raw")
    assert (raw.shots, raw.chat, raw.scripts) == (0, False, False)


def test_bad_protocol_arguments():
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'"):
        prompts.protocol("ouro", "gsm9k")
    with pytest.raises(ValueError, match="unknown prompt format 'fancy'"):
        prompts.protocol("ouro", "gsm8k", "fancy")


def test_ouro_plain_text_prompts():
    one_shot = dataclasses.replace(prompts.protocol("ouro", "gsm8k"), shots=1)
    assert prompts.build_prompt(one_shot, GSM) == f"Q: {SHOT_Q}\nA: {SHOT_A}\n\nQ: {GSM.question}\nA:"
    three = prompts.build_prompt(prompts.protocol("ouro", "gsm8k"), GSM)
    assert three.count("\nA: ") == 3 and three.count("The answer is") == 3 and three.endswith("How many?\nA:")
    assert prompts.build_prompt(prompts.protocol("ouro", "math500"), MATH) == (
        "Problem:\nWhat is $1+1$?\n\nSolve the problem step by step and put your final answer within \\boxed{}."
        "\n\nSolution:")
    two = prompts.build_prompt(dataclasses.replace(prompts.protocol("ouro", "math500"), shots=2), MATH)
    assert two.startswith("Problem:\nFind the domain") and two.count("\n\nSolution:\n") == 2
    assert "Final Answer" in two and prompts.MINERVA_INSTRUCTION not in two  # asked of Huginn only
    assert prompts.build_prompt(prompts.protocol("ouro", "humaneval"), CODE) == (
        "Please provide a self-contained Python script that solves the following problem in a markdown code block:\n"
        '```\ndef add(a, b):\n    """Sum."""\n```\n\n'
        "Below is a Python script with a self-contained function that solves the problem and passes corresponding "
        "tests:\n```python\n")
    assert prompts.build_prompt(prompts.protocol("ouro", "humaneval", "raw"), CODE) == CODE.prompt


def test_chat_template_with_a_system_prompt():
    """Huginn's GSM8K prompt through a ChatML template: the system prompt, the shots as earlier turns, the
    question and the generation prompt — equal to the string written out by hand."""
    one_shot = dataclasses.replace(prompts.protocol("huginn", "gsm8k"), shots=1)
    assert prompts.build_prompt(one_shot, GSM, ChatTemplate(CHATML)) == (
        "<|im_start|>system\nYou are a helpful assistant that can assist users with mathematical reasoning.<|im_end|>\n"
        f"<|im_start|>user\nQ: {SHOT_Q}\nA:<|im_end|>\n"
        f"<|im_start|>assistant\n{SHOT_A}<|im_end|>\n"
        "<|im_start|>user\nQ: Tom has 2 apples and buys 3. How many?\nA:<|im_end|>\n"
        "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="goes through its chat template, but the checkpoint"):
        prompts.build_prompt(one_shot, GSM, None)


def test_chat_math_and_code_prefill():
    """MATH500 for Huginn: Minerva shots, no system prompt, the boxed and Final Answer instructions. Code: the
    assistant turn rendered by the template (its bos token and `trim` included) and cut at the open fence."""
    huginn_like = ("{{ bos_token }}{% for m in messages %}<|begin_header|>{{ m['role'] }}<|end_header|>\n\n"
                   "{{ m['content'] | trim }}<|end_turn|>{% endfor %}"
                   "{% if add_generation_prompt %}<|begin_header|>Huginn<|end_header|>\n\n{% endif %}")
    template = ChatTemplate(huginn_like, {"bos_token": "<|begin_text|>"})
    math = prompts.build_prompt(prompts.protocol("huginn", "math500"), MATH, template)
    assert math.startswith("<|begin_text|><|begin_header|>user<|end_header|>\n\nProblem:\nFind the domain")
    assert math.count("<|begin_header|>assistant<|end_header|>\n\nSolution:\n") == 4
    assert math.count("Final Answer: The final answer is") == 4 + 5  # 4 worked answers; 5 user turns ask for it
    assert math.endswith("What is $1+1$?\n\nSolve the problem step by step and put your final answer within "
                         "\\boxed{}. " + prompts.MINERVA_INSTRUCTION + "<|end_turn|><|begin_header|>Huginn"
                         "<|end_header|>\n\n")
    assert "<|begin_header|>system" not in math
    code = prompts.build_prompt(prompts.protocol("huginn", "humaneval"), CODE, template)
    assert code == ("<|begin_text|><|begin_header|>user<|end_header|>\n\nPlease provide a self-contained Python "
                    "script that solves the following problem in a markdown code block:\n```\ndef add(a, b):\n"
                    '    """Sum."""\n```<|end_turn|><|begin_header|>assistant<|end_header|>\n\nBelow is a Python '
                    "script with a self-contained function that solves the problem and passes corresponding tests:\n"
                    "```python\n")
