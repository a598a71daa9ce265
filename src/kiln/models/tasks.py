"""Built-in lm-eval tasks for the built-in tiny model, made from text that ships with Python (its corpus).

Two tasks, one per kind of request lm-eval sends to an OpenAI-compatible endpoint:

- ``tiny-python-nextword`` (``generate_until``): a few lines of standard-library source and the first part of the
  next line; the model continues it (greedy, stopped at the line end) and is right when the first word it writes is
  the line's next word (``exact_match`` after a regex filter that keeps the first word).
- ``tiny-python-nextline`` (``multiple_choice``, scored by loglikelihood): a few lines of source and four
  candidate next lines (the true one and three lines from other documents); the model is right when the true line
  is the most likely (``acc``).

Both are cut from the calibration (training) split: the tiny model is too small to complete unseen code, so these
tasks measure how much of what it learned survives quantization, which is what the gate compares. The documents
are chosen by a fixed seed, in a fixed order (lm-eval's ``limit`` takes the first N). They are written as an
lm-eval task YAML plus a JSONL file — the same form a user's task has — by :func:`write_builtin_task`.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from kiln.models import corpus
from kiln.util.errors import InputError

#: Bump when the items made from the corpus change for the same corpus: it is part of each task's hash.
TASKS_VERSION = 1
SEED = 1234
ITEMS = 200
CONTEXT_LINES = 3
DATA_FILE = "data.jsonl"


def _candidate_lines(doc: str) -> list[tuple[str, str]]:
    """(context, line) pairs of a document: a line of code (not a comment, 16–100 characters) after CONTEXT_LINES
    non-empty lines."""
    lines = [ln.rstrip() for ln in doc.splitlines() if ln.strip()]
    out = []
    for i in range(CONTEXT_LINES, len(lines)):
        line = lines[i]
        body = line.strip()
        if 16 <= len(body) <= 100 and not body.startswith("#") and '"""' not in body:
            out.append(("\n".join(lines[i - CONTEXT_LINES:i]), line))
    return out


def _lines_items() -> list[dict]:
    rng = random.Random(SEED)
    items: list[dict] = []
    for doc in corpus.calibration_texts():
        pairs = _candidate_lines(doc)
        if not pairs:
            continue
        context, line = pairs[rng.randrange(len(pairs))]
        indent = len(line) - len(line.lstrip())
        spaces = [i for i, ch in enumerate(line) if ch == " " and i > indent + 4 and i < len(line) - 3]
        if not spaces:
            continue
        cut = spaces[len(spaces) // 2]
        items.append({"prompt": context + "\n" + line[:cut], "target": line[cut:].split()[0]})
        if len(items) == ITEMS:
            break
    return items


def _nextline_items() -> list[dict]:
    rng = random.Random(SEED + 1)
    docs = [pairs for pairs in (_candidate_lines(d) for d in corpus.calibration_texts()) if pairs]
    pool = [line for pairs in docs for _, line in pairs]
    items: list[dict] = []
    for pairs in docs:
        context, line = pairs[rng.randrange(len(pairs))]
        distractors: list[str] = []
        while len(distractors) < 3:
            other = pool[rng.randrange(len(pool))]
            if other.strip() != line.strip() and other not in distractors:
                distractors.append(other)
        choices = distractors[:]
        label = rng.randrange(4)
        choices.insert(label, line)
        items.append({"context": context, "choices": choices, "label": label})
        if len(items) == ITEMS:
            break
    return items


#: What both built-in tasks start with: their name and their JSONL file, the test split.
_SOURCE = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""

_YAML = {
    "tiny-python-nextword": """\
# kiln built-in task (kiln.models.tasks): the next word of a line of Python standard-library source.
""" + _SOURCE + """\
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: '^\\s*(\\S+)'
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: {version}
""",
    "tiny-python-nextline": """\
# kiln built-in task (kiln.models.tasks): pick the next line of Python standard-library source (loglikelihood).
""" + _SOURCE + """\
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: "\\n"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: {version}
""",
}


def task_name(name: str) -> str:
    """The lm-eval task name of a built-in task (``tiny-python-nextword`` → ``kiln_tiny_python_nextword``)."""
    return "kiln_" + name.replace("-", "_")


def builtin_items(name: str) -> list[dict]:
    if name == "tiny-python-nextword":
        return _lines_items()
    if name == "tiny-python-nextline":
        return _nextline_items()
    raise InputError(f"unknown built-in task builtin:{name}; known: builtin:tiny-python-nextword, "
                     "builtin:tiny-python-nextline")


def builtin_task_hash(name: str) -> str:
    """sha256 over the task's YAML template, version and items (changes when the corpus or the items change)."""
    digest = hashlib.sha256(_YAML[name].encode() + str(TASKS_VERSION).encode())
    for item in builtin_items(name):
        digest.update(json.dumps(item, sort_keys=True).encode() + b"\n")
    return "sha256:" + digest.hexdigest()


def write_builtin_task(name: str, directory: Path) -> Path:
    """Write the built-in task ``name`` as ``directory/task.yaml`` + ``directory/data.jsonl``; returns the YAML."""
    directory.mkdir(parents=True, exist_ok=True)
    items = builtin_items(name)
    (directory / DATA_FILE).write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
    path = directory / "task.yaml"
    path.write_text(_YAML[name].format(task=task_name(name), data=json.dumps(str((directory / DATA_FILE).resolve())),
                                       version=TASKS_VERSION), encoding="utf-8")
    return path
